package lakeshard.sql;

import java.util.ArrayList;
import java.util.List;

import org.apache.hadoop.hive.ql.session.SessionState;

import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.catalyst.FunctionIdentifier;
import org.apache.spark.sql.catalyst.TableIdentifier;
import org.apache.spark.sql.catalyst.catalog.SessionCatalog;
import org.apache.spark.sql.catalyst.catalog.TemporaryViewRelation;
import org.apache.spark.sql.catalyst.expressions.Expression;
import org.apache.spark.sql.catalyst.parser.ParameterContext;
import org.apache.spark.sql.catalyst.parser.ParseException;
import org.apache.spark.sql.catalyst.parser.ParserInterface;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.StructType;
import scala.Option;
import scala.collection.immutable.Seq;
import scala.jdk.javaapi.CollectionConverters;

/**
 * The parser of every session of the SQL endpoint: Spark's (with Delta's) parser, then
 * the installed {@link Guard} on every statement plan, which throws when the guard
 * refuses it. Fails closed: no guard installed, every statement is refused.
 *
 * <p>Each Thrift connection gets a session of its own; on its first statement the
 * server session's temporary views (lakeshard's views) are copied into it. A
 * connection that asks for session settings (a JDBC URL's `?k=v` hiveconf or `#k=v`
 * hivevar, which the Thrift server applies without a SET statement) may run nothing --
 * its opening `use db` is refused, so it never opens -- except the HiveServer2 client
 * settings Hive's JDBC driver sends itself (`hive.server2.*`), which Spark does not read.
 */
public final class ReadOnlyParser implements ParserInterface {
    // What Hive's JDBC driver sends on every connection (e.g. the fetch size).
    private static final String CLIENT_SETTINGS = "hive.server2.";
    private static volatile Guard guard;
    private static volatile SparkSession server;

    private final SparkSession session;
    private final ParserInterface delegate;
    private volatile boolean viewsCopied;

    public ReadOnlyParser(SparkSession session, ParserInterface delegate) {
        this.session = session;
        this.delegate = delegate;
    }

    /** Install the guard; `base` is the server's session, whose views connections get. */
    public static void install(Guard g, SparkSession base) {
        server = base;
        guard = g;
    }

    /** The first setting the connection of this thread asked for, or null. */
    public static String requestedSetting() {
        SessionState hive = SessionState.get();
        if (hive == null) {
            return null;
        }
        List<String> keys = new ArrayList<>(hive.getOverriddenConfigurations().keySet());
        keys.addAll(hive.getHiveVariables().keySet());
        for (String key : keys) {
            if (!key.startsWith(CLIENT_SETTINGS)) {
                return key;
            }
        }
        return null;
    }

    private void copyViews() {
        SparkSession base = server;
        if (viewsCopied || base == null || base == session) {
            return;
        }
        synchronized (this) {
            if (viewsCopied) {
                return;
            }
            SessionCatalog from = ((org.apache.spark.sql.classic.SparkSession) base)
                .sessionState().catalog();
            SessionCatalog to = ((org.apache.spark.sql.classic.SparkSession) session)
                .sessionState().catalog();
            for (TableIdentifier id : CollectionConverters.asJava(from.listLocalTempViews("*"))) {
                Option<TemporaryViewRelation> view = from.getRawTempView(id.table());
                if (view.isDefined()) {
                    to.createTempView(id.table(), view.get(), true);
                }
            }
            viewsCopied = true;
        }
    }

    private LogicalPlan checked(LogicalPlan plan) {
        Guard g = guard;
        String why;
        if (g == null) {
            why = "no read-only guard installed";
        } else {
            String asked = requestedSetting();
            why = asked != null
                ? "a session setting asked for by the connection (" + asked + ")"
                : g.refusal(plan, session);
        }
        if (why != null) {
            throw new ReadOnlyRefusal("lakeshard: refused: " + why
                + "; the endpoint runs a read-only query, EXPLAIN, SHOW or DESCRIBE over the "
                + "tables and the storage root only (docs/sql.md#read-only)");
        }
        copyViews();
        return plan;
    }

    @Override
    public LogicalPlan parsePlan(String sqlText) throws ParseException {
        return checked(delegate.parsePlan(sqlText));
    }

    @Override
    public LogicalPlan parsePlanWithParameters(String sqlText, ParameterContext context)
            throws ParseException {
        return checked(delegate.parsePlanWithParameters(sqlText, context));
    }

    @Override
    public LogicalPlan parseQuery(String sqlText) throws ParseException {
        return checked(delegate.parseQuery(sqlText));
    }

    @Override
    public Expression parseExpression(String sqlText) throws ParseException {
        return delegate.parseExpression(sqlText);
    }

    @Override
    public TableIdentifier parseTableIdentifier(String sqlText) throws ParseException {
        return delegate.parseTableIdentifier(sqlText);
    }

    @Override
    public FunctionIdentifier parseFunctionIdentifier(String sqlText) throws ParseException {
        return delegate.parseFunctionIdentifier(sqlText);
    }

    @Override
    public Seq<String> parseMultipartIdentifier(String sqlText) throws ParseException {
        return delegate.parseMultipartIdentifier(sqlText);
    }

    @Override
    public StructType parseRoutineParam(String sqlText) throws ParseException {
        return delegate.parseRoutineParam(sqlText);
    }

    @Override
    public StructType parseTableSchema(String sqlText) throws ParseException {
        return delegate.parseTableSchema(sqlText);
    }

    @Override
    public DataType parseDataType(String sqlText) throws ParseException {
        return delegate.parseDataType(sqlText);
    }
}
