package kappa.spark;

import java.util.ArrayDeque;

import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.execution.SparkPlan;
import org.apache.spark.sql.execution.metric.SQLMetric;
import org.apache.spark.sql.execution.streaming.runtime.IncrementalExecution;
import org.apache.spark.sql.execution.streaming.runtime.StreamingQueryWrapper;
import org.apache.spark.sql.streaming.StreamingQuery;

import scala.Option;
import scala.collection.Iterator;

/**
 * A SQL metric of a running streaming query's micro-batch, summed over its executed plan in one call.
 *
 * <p>Walked from Python through Py4J, the plan costs several calls into the JVM for each of its nodes; a view host
 * asks once per micro-batch of every view that keeps late rows (kappa.runtime.late.dropped_by_watermark).
 */
public final class PlanMetrics {
    private PlanMetrics() {
    }

    /**
     * The sum of metric {@code metric} over the executed plan of the last micro-batch of the active query named
     * {@code queryName}; -1 when there is no such active query or it has run no micro-batch yet.
     */
    public static long activeQuerySum(SparkSession session, String queryName, String metric) {
        for (StreamingQuery query : session.streams().active()) {
            if (!queryName.equals(query.name()) || !(query instanceof StreamingQueryWrapper wrapper)) {
                continue;
            }
            IncrementalExecution execution = wrapper.streamingQuery().lastExecution();
            return execution == null ? -1 : sum(execution.executedPlan(), metric);
        }
        return -1;
    }

    /** The sum of metric {@code metric} over {@code plan} and its children, recursively. */
    public static long sum(SparkPlan plan, String metric) {
        long total = 0;
        ArrayDeque<SparkPlan> stack = new ArrayDeque<>();
        stack.push(plan);
        while (!stack.isEmpty()) {
            SparkPlan node = stack.pop();
            Option<SQLMetric> found = node.metrics().get(metric);
            if (found.isDefined()) {
                total += found.get().value();
            }
            Iterator<SparkPlan> children = node.children().iterator();
            while (children.hasNext()) {
                stack.push(children.next());
            }
        }
        return total;
    }
}
