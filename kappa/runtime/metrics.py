"""Prometheus metrics of a running view job (prometheus-client), labelled by view and version.

Fed by three sources: the streaming query listener (rates, batch duration, watermark), the sink after each
Delta commit (rows written, quarantined records, Delta version, end-to-end latency), and a lag poller that asks
Kafka for the log end offsets.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily

__all__ = ["ViewMetrics", "LATENCY_BUCKETS"]

#: End-to-end latency buckets (seconds), event time -> row committed in Delta.
LATENCY_BUCKETS: tuple[float, ...] = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600, 1800)


@dataclass(eq=False)
class _BulkHistogram:
    """A histogram fed with pre-bucketed counts (computed in Spark), exposed as a Prometheus histogram."""

    name: str
    doc: str
    labels: Mapping[str, str]
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def add(self, bucket_counts: Iterable[tuple[int, int]], value_sum: float) -> None:
        """Add ``(bucket index, count)`` pairs; index ``len(buckets)`` is the +Inf bucket."""
        with self.lock:
            for index, count in bucket_counts:
                self.counts[min(int(index), len(self.buckets))] += int(count)
            self.total += float(value_sum)

    def collect(self):  # prometheus_client collector protocol
        with self.lock:
            cumulative, running = [], 0
            for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts):
                running += count
                cumulative.append((bound, running))
            total = self.total
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), cumulative, total)
        yield family


class ViewMetrics:
    """All metrics of one view-version driver, in their own registry (one HTTP endpoint per job)."""

    def __init__(self, view: str, version: int, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"view": view, "version": str(version)}
        names = list(self.labels)
        r = self.registry

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, names + list(extra), registry=r)

        self.input_rate = gauge("kappa_input_rows_per_second", "Rows/s read from Kafka (last batch).")
        self.processed_rate = gauge("kappa_processed_rows_per_second", "Rows/s processed (last batch).")
        self.input_rows = Counter("kappa_input_rows", "Kafka records read.", names, registry=r)
        self.batch_duration = Histogram(
            "kappa_batch_duration_seconds", "Micro-batch duration.", names, registry=r,
            buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120))
        self.batches = Counter("kappa_batches", "Micro-batches committed.", names, registry=r)
        self.batches_failed = Counter("kappa_batches_failed", "Micro-batches that raised.", names, registry=r)
        # exported at 0 from the start: the first failure is then an increase Prometheus can see (a series that
        # first appears at 1 shows none until the second)
        self.batches_failed.labels(**self.labels)
        self.rows_written = Counter("kappa_rows_written", "Rows in committed output batches.", names, registry=r)
        self.quarantined = Counter("kappa_quarantined_records", "Bad records sent to quarantine.", names,
                                   registry=r)
        self.last_delta_version = gauge("kappa_last_delta_version", "Last Delta version committed by the job.")
        self.last_batch_id = gauge("kappa_last_batch_id", "Last micro-batch id committed.")
        self.watermark_delay = gauge("kappa_watermark_delay_seconds", "Wall clock minus event-time watermark.")
        self.rows_dropped_late = gauge("kappa_rows_dropped_by_watermark",
                                       "Rows dropped as too late by the stateful operator (last batch).")
        self.late_dropped = Counter("kappa_late_rows_dropped", "Rows the stateful operator dropped as too late "
                                    "(Spark's numRowsDroppedByWatermark, summed over batches; for an aggregation "
                                    "it counts partially aggregated rows).", names, registry=r)
        self.late_kept = Counter("kappa_late_records_kept", "Late records the watermark dropped that were kept in "
                                 "the quarantine (reason late; views that declare a late bound).", names, registry=r)
        self.expectation_rows = Counter("kappa_expectation_rows_checked", "Output rows checked against the view "
                                        "version's expectations.", names, registry=r)
        self.expectation_violations = Counter(
            "kappa_expectation_violations", "Output rows that broke an expectation (action: warn = written anyway, "
            "drop = quarantined, fail = the job stopped).", names + ["expectation", "action"], registry=r)
        self.lag = gauge("kappa_partition_lag_records", "Log end offset minus processed offset.",
                         ("topic", "partition"))
        self.log_end = gauge("kappa_partition_log_end_offset", "Log end offset.", ("topic", "partition"))
        self.processed_offset = gauge("kappa_partition_processed_offset", "Next offset to process.",
                                      ("topic", "partition"))
        self.phase_seconds = gauge("kappa_batch_phase_seconds",
                                   "Seconds the last micro-batch spent in a phase (compute = read + decode + "
                                   "transform, write, quarantine, bookkeeping; Spark's own: plan, offsets, commit).",
                                   ("phase",))
        self.progress = gauge("kappa_replay_progress_ratio",
                              "Share of the records between the start position and the log end processed (with what "
                              "a long micro-batch running now has read).")
        self.kafka_reachable = gauge("kappa_kafka_reachable", "1 when the job's last look at its topic's offsets "
                                     "reached the broker, 0 while it cannot (the job waits).")
        self.kafka_unreachable_seconds = gauge("kappa_kafka_unreachable_seconds",
                                               "Seconds since the job last reached the broker (0 while it does).")
        self.eta = gauge("kappa_replay_eta_seconds", "Estimated seconds until caught up (lag / processed rate, or "
                         "the read rate of a long micro-batch running now; 0 once the run's target was reached).")
        self.batch_read = gauge("kappa_batch_records_read", "Records of the micro-batch running now read so far, "
                                "estimated from its finished read tasks (batches over 50,000 records that have run "
                                "2 s; 0 otherwise).")
        self.waiting_for_topic = gauge("kappa_waiting_for_topic", "1 while the job waits for a topic it reads to "
                                       "be created (it starts once every one exists), 0 once it exists.", ("topic",))
        self.falling_behind = gauge("kappa_falling_behind", "1 while live micro-batches take longer than the "
                                    "trigger interval (3 in a row; 0 again after 3 that fit).")
        self.trigger_seconds = gauge("kappa_trigger_seconds", "How often the live query's micro-batches run: the "
                                     "declared trigger, or a longer one given by a view host under load (0 for a "
                                     "bounded run).")
        self.published_rows = Counter("kappa_published_rows", "Rows of the table published to the version's "
                                      "publish topic (views of views; copies re-published after a crash count "
                                      "again).", names, registry=r)
        self.published_version = gauge("kappa_published_delta_version", "Last Delta version of the table whose "
                                       "rows are published to its publish topic.")
        self.latency = _BulkHistogram(
            "kappa_end_to_end_latency_seconds", "Event time to committed in Delta.", self.labels, LATENCY_BUCKETS)
        r.register(self.latency)
        self._server = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``port`` (0 picks a free port); returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # convenience accessors used by the job ------------------------------------------------------------
    def g(self, metric: Gauge, **extra: str):
        return metric.labels(**self.labels, **extra)
