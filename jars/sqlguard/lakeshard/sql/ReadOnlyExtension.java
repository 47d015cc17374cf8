package lakeshard.sql;

import org.apache.spark.sql.SparkSessionExtensions;
import scala.runtime.AbstractFunction1;
import scala.runtime.BoxedUnit;

/** `spark.sql.extensions=lakeshard.sql.ReadOnlyExtension`: every session's parser is
 *  wrapped in {@link ReadOnlyParser}. */
public final class ReadOnlyExtension extends AbstractFunction1<SparkSessionExtensions, BoxedUnit> {
    @Override
    public BoxedUnit apply(SparkSessionExtensions extensions) {
        extensions.injectParser(new scala.runtime.AbstractFunction2<
                org.apache.spark.sql.SparkSession,
                org.apache.spark.sql.catalyst.parser.ParserInterface,
                org.apache.spark.sql.catalyst.parser.ParserInterface>() {
            @Override
            public org.apache.spark.sql.catalyst.parser.ParserInterface apply(
                    org.apache.spark.sql.SparkSession session,
                    org.apache.spark.sql.catalyst.parser.ParserInterface parser) {
                return new ReadOnlyParser(session, parser);
            }
        });
        return BoxedUnit.UNIT;
    }
}
