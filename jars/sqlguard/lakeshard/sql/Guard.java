package lakeshard.sql;

import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;

/** Judges a parsed statement: why it may not run in `session`, or null when it may.
 *  Implemented in Python (etl/lakehouse/readonly.py, through py4j): one rule, one home. */
public interface Guard {
    String refusal(LogicalPlan plan, SparkSession session);
}
