package kappa.sql;

import java.util.Collections;
import java.util.Map;
import java.util.Set;
import java.util.WeakHashMap;

import org.apache.hadoop.fs.Path;
import org.apache.spark.sql.SparkSessionExtensions;
import org.apache.spark.sql.catalyst.analysis.PersistedView$;
import org.apache.spark.sql.catalyst.expressions.Expression;
import org.apache.spark.sql.catalyst.plans.logical.Command;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import org.apache.spark.sql.execution.command.CreateViewCommand;
import org.apache.spark.sql.execution.datasources.HadoopFsRelation;
import org.apache.spark.sql.execution.datasources.LogicalRelation;

import scala.Function1;
import scala.collection.Iterator;
import scala.runtime.AbstractFunction1;
import scala.runtime.BoxedUnit;

/**
 * The SQL service's read-only guard: a Spark check rule (spark.sql.extensions) run on every analyzed plan of every
 * session the service opens for a client (JDBC, Spark Connect).
 *
 * <p>It admits queries, and of the commands only those that read: SHOW, DESCRIBE, EXPLAIN, SET, USE and temporary
 * views. A query may read the lake's Delta tables (the files under the lake given as the system property
 * {@code kappa.sql.lake}) and literal rows; nothing else: no other file, no streaming source, no JDBC source, no
 * user code (Python UDFs, typed closures, TRANSFORM scripts, reflection). Anything else fails its analysis
 * with one line naming what was refused, before it runs.
 *
 * <p>The service's own session (the one that keeps {@code analytics.<view>} pointing at the serving versions) is
 * registered with {@link #trust} and is not checked.
 */
public final class ReadOnly extends AbstractFunction1<SparkSessionExtensions, BoxedUnit> {

    private static final Set<Object> TRUSTED = Collections.newSetFromMap(new WeakHashMap<>());

    /** Commands that only read the catalog or the session (by simple class name). */
    private static final Set<String> READING_COMMANDS = Set.of(
            "ShowTables", "ShowTablesExtended", "ShowTablesCommand", "ShowNamespaces", "ShowViews",
            "ShowViewsCommand", "ShowColumns", "ShowColumnsCommand", "ShowFunctions", "ShowFunctionsCommand",
            "ShowCatalogs", "ShowCatalogsCommand", "ShowCurrentNamespace", "ShowCurrentNamespaceCommand",
            "ShowTableProperties", "ShowTablePropertiesCommand", "ShowCreateTable", "ShowCreateTableCommand",
            "ShowCreateTableAsSerdeCommand", "DescribeRelation", "DescribeTableCommand", "DescribeColumn",
            "DescribeColumnCommand", "DescribeNamespace", "DescribeDatabaseCommand", "DescribeFunction",
            "DescribeFunctionCommand", "DescribeQueryCommand", "ExplainCommand", "SetCommand", "ResetCommand",
            "SetCatalogAndNamespace", "SetCatalogCommand", "SetNamespaceCommand", "DescribeDeltaHistory",
            "DescribeDeltaHistoryCommand", "DescribeDeltaDetailCommand");

    /**
     * Plan nodes that run code a client sends: Python and R functions, and TRANSFORM's scripts. (Typed closures -
     * MapPartitions and the like - are also Delta's own reading plans; a client's come only through Spark Connect,
     * which {@link ConnectGuard} refuses in the request.)
     */
    private static final String[] CODE_NODES = {"Python", "Pandas", "InArrow", "InR", "ScriptTransformation"};

    /**
     * Expressions that run code a client sends or call methods by name. (Scala functions are Delta's own here: a
     * client's never reach a plan, {@link ConnectGuard} refuses them in the request.)
     */
    private static final String[] CODE_EXPRESSIONS = {"Python", "Reflect"};

    /** Leaves that read no file and no source. */
    private static final Set<String> LITERAL_LEAVES = Set.of(
            "LocalRelation", "Range", "OneRowRelation", "CTERelationRef", "EmptyRelation",
            // the rows of a Delta change feed (table_changes) are one; a client cannot make one here (its
            // checkpoint and cached-relation commands are refused)
            "LogicalRDD");

    /** Register the service's own session: its plans are not checked. */
    public static void trust(Object session) {
        synchronized (TRUSTED) {
            TRUSTED.add(session);
        }
    }

    private static boolean trusted(Object session) {
        synchronized (TRUSTED) {
            return TRUSTED.contains(session);
        }
    }

    @Override
    @SuppressWarnings({"rawtypes", "unchecked"})
    public BoxedUnit apply(SparkSessionExtensions extensions) {
        Function1 builder = new AbstractFunction1<Object, Function1<LogicalPlan, BoxedUnit>>() {
            @Override
            public Function1<LogicalPlan, BoxedUnit> apply(Object session) {
                return new Check(session);
            }
        };
        extensions.injectCheckRule(builder);
        return BoxedUnit.UNIT;
    }

    static final class Check extends AbstractFunction1<LogicalPlan, BoxedUnit> {
        private final Object session;
        private Lake lake;

        Check(Object session) {
            this.session = session;
        }

        @Override
        public BoxedUnit apply(LogicalPlan plan) {
            if (trusted(session)) {
                return BoxedUnit.UNIT;
            }
            if (lake == null) {
                lake = Lake.fromProperty();
            }
            if (plan instanceof Command) {
                String name = plan.getClass().getSimpleName();
                if (READING_COMMANDS.contains(name)) {
                    return BoxedUnit.UNIT;
                }
                if (plan instanceof CreateViewCommand
                        && ((CreateViewCommand) plan).viewType() == PersistedView$.MODULE$) {
                    throw refused("CREATE VIEW (a persistent view; CREATE TEMPORARY VIEW is allowed)");
                }
                if (plan instanceof CreateViewCommand) {
                    return BoxedUnit.UNIT;
                }
                throw refused(describe(name));
            }
            visit(plan);
            return BoxedUnit.UNIT;
        }

        private void visit(LogicalPlan node) {
            String name = node.getClass().getSimpleName();
            if (node instanceof Command) {
                throw refused(describe(name));
            }
            for (String code : CODE_NODES) {
                if (name.contains(code)) {
                    throw refused(name + " (code sent by the client)");
                }
            }
            if (node.children().isEmpty()) {
                leaf(node, name);
            }
            Iterator<Expression> expressions = node.expressions().iterator();
            while (expressions.hasNext()) {
                expression(expressions.next());
            }
            Iterator<LogicalPlan> subqueries = node.subqueries().iterator();
            while (subqueries.hasNext()) {
                visit(subqueries.next());
            }
            Iterator<LogicalPlan> children = node.children().iterator();
            while (children.hasNext()) {
                visit(children.next());
            }
        }

        private void expression(Expression expression) {
            String name = expression.getClass().getSimpleName();
            for (String code : CODE_EXPRESSIONS) {
                if (name.contains(code)) {
                    throw refused(name + " (a user-defined function or a method called by name)");
                }
            }
            Iterator<Expression> children = expression.children().iterator();
            while (children.hasNext()) {
                expression(children.next());
            }
        }

        private void leaf(LogicalPlan node, String name) {
            if (LITERAL_LEAVES.contains(name)) {
                return;
            }
            if (node instanceof LogicalRelation) {
                Object relation = ((LogicalRelation) node).relation();
                String kind = relation.getClass().getSimpleName();
                if (relation instanceof HadoopFsRelation) {
                    Iterator<Path> roots = ((HadoopFsRelation) relation).location().rootPaths().iterator();
                    boolean any = false;
                    while (roots.hasNext()) {
                        Path root = roots.next();
                        any = true;
                        if (!lake.contains(root)) {
                            throw refused("reading " + root + " (only the lake's tables can be read)");
                        }
                    }
                    if (any) {
                        return;
                    }
                    throw refused("reading files outside the lake");
                }
                if (kind.startsWith("DeltaCDF")) {  // table_changes(...): a Delta table's change feed
                    return;
                }
                throw refused("reading " + kind + " (only the lake's tables can be read)");
            }
            throw refused("reading " + name + " (only the lake's tables can be read)");
        }

        private static String describe(String command) {
            return command.replaceAll("Command$", "") + " (a command that writes or changes the catalog)";
        }
    }

    static UnsupportedOperationException refused(String what) {
        return new UnsupportedOperationException("kappa sql is read-only: " + what + " is refused");
    }

    /** The lake's root, as {@code scheme://authority/path}, from the system property {@code kappa.sql.lake}. */
    static final class Lake {
        private final String scheme;
        private final String authority;
        private final String path;

        private Lake(String uri) {
            java.net.URI u = new Path(uri).toUri();
            this.scheme = u.getScheme() == null ? "file" : u.getScheme();
            this.authority = u.getAuthority() == null ? "" : u.getAuthority();
            this.path = u.getPath().replaceAll("/+$", "");
        }

        static Lake fromProperty() {
            String uri = System.getProperty("kappa.sql.lake");
            if (uri == null || uri.isEmpty()) {
                throw new IllegalStateException("kappa.sql.lake is not set: the read-only guard has no lake");
            }
            return new Lake(uri);
        }

        boolean contains(Path candidate) {
            java.net.URI u = candidate.toUri();
            String s = u.getScheme() == null ? "file" : u.getScheme();
            String a = u.getAuthority() == null ? "" : u.getAuthority();
            String p = u.getPath();
            return s.equals(scheme) && a.equals(authority) && (p.equals(path) || p.startsWith(path + "/"));
        }
    }
}
