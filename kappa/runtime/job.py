"""The plumbing that runs any view version: Kafka -> decode/quarantine -> pure transform -> idempotent Delta.

One driver per view version (``kappa.runtime.lock``). State of a view version lives under
``<lake>/views/<view>/v<N>/``: ``table/`` (the Delta table), ``checkpoint/`` (Spark offsets, commits and
operator state, plus ``run.json`` holding the run id that makes the Delta appId). The Delta appId is
``kappa:<view>@v<N>:<run id>`` and the Delta txnVersion is the micro-batch id, so:

* a batch re-run after a crash (Delta committed, checkpoint not) is skipped by Delta;
* a new version (or a deliberately new run) has a new appId, so a replay is never silently skipped.

Bad records go to the shared ``<lake>/quarantine`` Delta table exactly once, keyed the same way, from the same
micro-batch: every view version runs *one* streaming query that reads and decodes its topic once per batch
(:mod:`kappa.runtime.plan`); :mod:`kappa.runtime.batch` commits each batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from kappa.runtime.batch import BatchHandler, fault
from kappa.runtime.deltars import rs_uri
from kappa.runtime.checkpoint import RunMismatch, batch_ids, last_commit, offsets_of, open_run, run_progress, save_run_info
from kappa.errors import one_line
from kappa.identity import ViewPaths, app_id
from kappa.runtime.lineage import batch_metadata, parse_offset_log
from kappa.runtime.lock import DriverLock, LakeLease
from kappa.runtime.late import dropped_by_watermark, late_records
from kappa.runtime.inflight import READ_SPLIT_RECORDS
from kappa.runtime.lookups import LookupCache
from kappa.runtime.metrics import ViewMetrics
from kappa.runtime.parsing import decode
from kappa.runtime.plan import stateful_plan
from kappa.runtime.sink import DeltaSink, QuarantineSink, create_view_tables, seed_table
from kappa.runtime.view import ViewDefinition

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

    from kappa.config import Settings

__all__ = ["ViewJob", "RunMismatch", "failure_line", "starting_options"]

log = logging.getLogger("kappa.runtime.job")

#: Seconds one attempt at the log's offsets waits for an unreachable broker (the Kafka client's
#: ``default.api.timeout.ms``).
OFFSET_ATTEMPT_SECONDS = 60


def starting_options(starting: str | Mapping[str, Any]) -> dict[str, str]:
    """Spark Kafka source options for a starting position.

    ``earliest`` | ``latest`` | ``ts:<epoch ms>`` | a JSON object ``{"topic": {"0": offset, ...}}`` (or a dict).
    Only used when the checkpoint is new; a resumed job continues from its checkpoint.
    """
    if isinstance(starting, Mapping):
        return {"startingOffsets": json.dumps(starting)}
    value = starting.strip()
    if value in ("earliest", "latest"):
        return {"startingOffsets": value}
    if value.startswith("ts:"):
        ts = value[3:]
        if not ts.isdigit():
            raise ValueError(f"starting position {value!r}: expected ts:<epoch millis>")
        return {"startingTimestamp": ts}
    if value.startswith("{"):
        try:
            json.loads(value)
        except ValueError as exc:
            raise ValueError(f"starting offsets are not valid JSON: {exc}") from None
        return {"startingOffsets": value}
    raise ValueError(f"starting position {value!r}: use earliest, latest, ts:<epoch ms> or JSON offsets")


#: Message of the progress-reporting NullPointerException of Spark 4.1's Kafka source (SPARK-55271).
_SPARK_55271 = 'Cannot invoke "scala.collection.IterableOps.map(scala.Function1)" because the return value of ' \
    '"scala.Option.get()" is null'


#: Longest time between two looks at whether a running job's queries failed or ended when no listener event said
#: one did (:meth:`ViewJob.ended_maybe`).
FULL_CHECK_SECONDS = 30.0

#: A publishing version's table keeps its whole history while its publisher is more than this many commits behind
#: (a trigger's worth normally; the publisher stalls while Kafka is away).
PUBLISH_HOLD_COMMITS = 100

#: Spark's phases of a micro-batch (progress ``durationMs`` keys) reported beside ours.
SPARK_PHASES = {"offsets": ("latestOffset",), "plan": ("queryPlanning", "getBatch"),
                "commit": ("walCommit", "commitOffsets")}


class _Pace:
    """Whether a live query's micro-batches outlast its trigger interval ("falling behind": Spark starts the next
    batch at once and the lag holds or grows). Spark's own warning comes at every such batch; this changes state
    only after :attr:`RUN` batches in a row on the other side, so a busy machine's odd slow batch says nothing and
    a state is announced once when it starts and once when it ends."""

    RUN = 3

    def __init__(self) -> None:
        self.behind = False
        self._streak = 0  # consecutive batches contradicting the current state
        self._batches = 0  # batches since the state began
        self._since = time.monotonic()
        self._longest = 0.0

    def batch(self, seconds: float, trigger: float) -> str | None:
        """Account for one batch; the line to log when the state changed, else None."""
        self._batches += 1
        over = seconds > trigger
        if self.behind:
            self._longest = max(self._longest, seconds)
        self._streak = self._streak + 1 if over != self.behind else 0
        if self._streak < self.RUN:
            return None
        elapsed, batches, longest = time.monotonic() - self._since, self._batches, self._longest
        self.behind, self._streak, self._batches, self._since, self._longest = over, 0, 0, time.monotonic(), seconds
        if over:
            return (f"falling behind: {self.RUN} micro-batches in a row took longer than the {trigger:g} s trigger "
                    f"(last {seconds:.1f} s); each next one starts at once and the lag is in "
                    "kappa_partition_lag_records (kappa_falling_behind 1 until it keeps up again)")
        return (f"keeping up again: micro-batches fit the {trigger:g} s trigger after {batches} batches over "
                f"{elapsed:.0f} s (longest {longest:.1f} s)")


def _offsets_json(text: str | None) -> dict | None:
    """Kafka source offsets from a progress report (``None`` when absent or not JSON)."""
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


_PYTHON_ERROR = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Failed|Exit)): (.+)$")


class ProgressListener:
    """A streaming query listener that hands ``on_progress`` the progress of the queries named ``names`` only
    (a :class:`pyspark.sql.streaming.StreamingQueryProgress`), read from the JVM as one JSON document, and calls
    ``on_terminated`` when any query of the session ended; other events and other queries' progress cost one call
    into the JVM or none. For ``spark.streams.addListener``."""

    def __init__(self, names: set[str], on_progress: Callable[[Any], None],
                 on_terminated: Callable[[], None] = lambda: None) -> None:
        names = set(names)

        class _J:  # the py4j side of org.apache.spark.sql.streaming.PythonStreamingQueryListener
            def onQueryStarted(self, jevent: Any) -> None:
                pass

            def onQueryProgress(self, jevent: Any) -> None:
                from pyspark.sql.streaming.listener import StreamingQueryProgress

                jprogress = jevent.progress()
                if jprogress.name() in names:
                    on_progress(StreamingQueryProgress.fromJson(json.loads(jprogress.json())))

            def onQueryIdle(self, jevent: Any) -> None:
                pass

            def onQueryTerminated(self, jevent: Any) -> None:
                on_terminated()  # whichever query it was: terminations are rare, and asking costs a JVM call

            class Java:
                implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]

        self._j = _J()
        self._jlistenerobj: Any = None

    @property
    def _jlistener(self) -> Any:
        """What ``spark.streams.addListener`` / ``removeListener`` register (as PySpark's own listeners do)."""
        if self._jlistenerobj is None:
            from pyspark import SparkContext

            self._jlistenerobj = SparkContext._jvm.PythonStreamingQueryListenerWrapper(self._j)
        return self._jlistenerobj


def failure_line(text: str) -> str:
    """One line for a query failure: the last Python ``<Error>: <message>`` line of an embedded traceback (the
    error of the user's code in ``foreachBatch``), else the first line."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if starts:  # the traceback's frames are indented; its first unindented line is the error
        for line in lines[starts[-1] + 1:]:
            if line[:1].isspace():
                continue
            found = _PYTHON_ERROR.match(line.strip())
            if found:
                return f"{found.group(1)}: {found.group(2)}"
            break
    return lines[0] if lines else text


def _lock_path(paths: ViewPaths, settings: "Settings") -> Path:
    """The driver lock of a view version: beside its checkpoint on a local lake; on an object store (no file locks
    there) under ``<home>/locks/``, keyed by the lake's URI - drivers on one machine exclude each other as on a
    local lake; across machines, the driver's lease on the lake (:class:`kappa.runtime.lock.LakeLease`)."""
    if paths.is_local:
        return paths.local("driver.lock")
    lake = hashlib.sha256(paths.lake.encode()).hexdigest()[:12]
    return Path(settings.home) / "locks" / lake / paths.name / f"v{paths.version}" / "driver.lock"


def _no_guard() -> None:
    """A local lake's commits need no check: the driver lock beside the checkpoint excludes every other driver."""


#: How often a live view's micro-batches run when neither platform.yaml nor the view's module says.
DEFAULT_TRIGGER_SECONDS = 2.0


def live_trigger_seconds(view: ViewDefinition, catalog: Any = None) -> float:
    """How often ``view``'s live micro-batches run: the ``trigger`` platform.yaml declares for the view (an
    operational setting, the same for every version), else what the version's module declares, else 2 s.
    ``catalog``: platform.yaml already loaded (:func:`kappa.catalog.load_catalog`)."""
    from kappa.catalog import load_catalog

    spec = (catalog or load_catalog()).views.get(view.name)
    declared = spec.trigger_seconds if spec is not None else None
    return declared or view.trigger_seconds or DEFAULT_TRIGGER_SECONDS


class ViewJob:
    """Runs one view version until stopped (live) or until the available data is processed (bounded).

    Args:
        view: the view version to run.
        settings: platform settings (Kafka, lake root, jars).
        spark: an existing SparkSession (tests share one); a new one is built when omitted.
        starting: start position for a new checkpoint (see :func:`starting_options`).
        trigger_seconds: processing-time trigger of live runs; None: :func:`live_trigger_seconds` (the view's
            ``trigger`` in platform.yaml, else its module's, else 2 s).
        available_now: process what the log holds at start, then stop (bounded backfill, tests).
        end_timestamp_ms: only records with a Kafka timestamp before this are processed (bounded backfill).
        max_offsets_per_trigger: bound micro-batch size (replays).
        metrics_port: serve Prometheus metrics on this port (0 = any free port, None = no server).
        lag_poll_seconds: how often the log end offsets are asked for (lag, progress metrics).
        lookups: a lookup cache shared with other views of the same Spark application (the view host).
    """

    def __init__(
        self,
        view: ViewDefinition,
        settings: "Settings",
        *,
        spark: "SparkSession | None" = None,
        starting: str | Mapping[str, Any] = "latest",
        trigger_seconds: float | None = None,
        available_now: bool = False,
        end_timestamp_ms: int | None = None,
        max_offsets_per_trigger: int | None = None,
        metrics_port: int | None = None,
        lag_poll_seconds: float = 3.0,
        lookups: LookupCache | None = None,
    ) -> None:
        self.view = view
        self.settings = settings
        self.paths = ViewPaths(settings.lake_uri, view.name, view.version)
        self.starting = starting_options(starting)
        self.trigger_seconds = trigger_seconds or live_trigger_seconds(view)
        self.available_now = available_now
        self.end_timestamp_ms = end_timestamp_ms
        self.max_offsets_per_trigger = max_offsets_per_trigger
        self.metrics = ViewMetrics(view.name, view.version)
        self.metrics_port = metrics_port
        self.lag_poll_seconds = lag_poll_seconds
        self._spark = spark
        self._own_spark = spark is None
        self._lock = DriverLock(_lock_path(self.paths, settings), owner=view.ref)
        # on an object store the lock above excludes this machine's drivers only; the lease, every machine's
        self._lease = None if self.paths.is_local else LakeLease(
            f"{self.paths.checkpoint}/driver.lease", owner=view.ref, ttl_seconds=settings.driver_lease_seconds)
        self.queries: list[StreamingQuery] = []
        self._listener: Any = None
        self._terminated = threading.Event()  # the listener saw a query end (see ended_maybe)
        self._offset_texts: dict[str, str] = {}  # the offset log's last entries read (see _checkpoint_text)
        self._next_full_check = 0.0
        self._stop = threading.Event()
        self._batches_ended = 0  # progress events of the main query (one per committed micro-batch)
        self._batch_ended = threading.Condition()
        self._lag_thread: threading.Thread | None = None
        self.run_id: str | None = None
        self._run_info: dict[str, Any] = {}  # run.json (kappa.runtime.checkpoint.open_run)
        self.app_id: str | None = None
        self.start_offsets: dict[int, int] | None = None
        self.target_offsets: dict[int, int] | None = None  # what the run had to reach when it started
        self.processed_offsets: dict[int, int] = {}
        self._last_batch: int | None = None  # the main query's last committed micro-batch (progress events)
        self._reading: Any = None  # kappa.runtime.inflight.Reading of a long running micro-batch, else None
        self._pace = _Pace()  # whether micro-batches outlast the trigger (said once when it starts and ends)
        self.bound_port: int | None = None
        self._recoveries = 0
        self.late_batches: list[int] = []  # micro-batches whose late records were looked for (kappa.runtime.late)
        self._lookup_cache: LookupCache | None = lookups
        self._own_lookups = lookups is None
        self.publisher: Any = None  # kappa.runtime.publish.Publisher of a version that publishes
        self.repairs: Any = None  # kappa.runtime.repairs.RepairInbox (object-store lakes)
        self.keeper: Any = None  # kappa.runtime.upkeep.TableKeeper of a live job
        self._stream: Any = None  # the view query's plan (planned when the query first starts)
        self._archive_running = False  # the run's archive part (a query of its own) is running

    # ---------------------------------------------------------------------------------------------------
    @property
    def spark(self) -> "SparkSession":
        if self._spark is None:
            from kappa.runtime.spark import build_spark, view_shuffle_partitions

            self._spark = build_spark(f"kappa-{self.view.ref}", self.settings,
                                      shuffle_partitions=view_shuffle_partitions(self.settings))
        return self._spark

    @property
    def query_name(self) -> str:
        return f"{self.view.ref}:main"

    @property
    def archive_query_name(self) -> str:
        """The query of a replay's first micro-batch, from the archive and the log (:meth:`_from_archive`); its
        progress counts like the main query's."""
        return f"{self.view.ref}:archive"

    def _kafka_options(self) -> dict[str, str]:
        return dict(self.settings.spark_kafka_options())

    def _outage_options(self) -> dict[str, str]:
        """A broker outage is waited out, not failed on: each attempt at the log's offsets waits for the broker
        up to the client's API timeout (60 s); the micro-batch retries for ``KAPPA_KAFKA_OUTAGE_SECONDS``
        before the query fails (Spark's default, 3 attempts, gave up after ~3 minutes)."""
        attempts = max(3, math.ceil(self.settings.kafka_outage_seconds / (OFFSET_ATTEMPT_SECONDS + 1)))
        return {"fetchOffset.numRetries": str(attempts), "fetchOffset.retryIntervalMs": "1000"}

    def _read_stream(self, topic: str, *, starting: Mapping[str, str] | None = None) -> "DataFrame":
        reader = self.spark.readStream.format("kafka").options(**self._kafka_options())
        reader = reader.option("subscribe", topic).options(**(starting or self.starting)).options(**self._outage_options())
        # a compacted topic has offset gaps by design; a deleted-by-retention one is real data loss
        compacted = self.view.stream_format.tombstones
        reader = reader.option("failOnDataLoss", "false" if compacted else "true")
        if self.max_offsets_per_trigger:
            reader = reader.option("maxOffsetsPerTrigger", str(self.max_offsets_per_trigger))
        # a big batch (a replay, a catch-up) is read by many tasks: every core busy, progress inside the batch
        return reader.option("maxRecordsPerPartition", str(READ_SPLIT_RECORDS)).load()

    def _decoded_stream(self) -> "DataFrame":
        return self._decode(self._read_stream(self.settings.topic(self.view.stream_topic)))

    def _decode(self, raw: "DataFrame") -> "DataFrame":
        """Kafka records -> :func:`kappa.runtime.parsing.decode` output, up to the bounded end (stream and re-reads)."""
        from pyspark.sql import functions as F

        decoded = decode(raw, self.view.stream_format)
        if self.end_timestamp_ms is not None:
            decoded = decoded.where(F.col("kafka_timestamp") < F.timestamp_millis(F.lit(self.end_timestamp_ms)))
        return decoded

    @property
    def lookups(self) -> LookupCache:
        if self._lookup_cache is None:
            self._lookup_cache = LookupCache(self.spark, self.settings)
        return self._lookup_cache

    # ---------------------------------------------------------------------------------------------------
    def _prepare_run(self) -> None:
        """Create or resume the run (:func:`kappa.runtime.checkpoint.open_run`: the checkpoint's run id, matched
        against the table's)."""
        info = open_run(self.paths, starting=self.starting, files=self._files)
        self.run_id = info["run_id"]
        self.app_id = app_id(self.view.name, self.view.version, self.run_id)
        if info.get("start_offsets"):
            self.start_offsets = offsets_of(info["start_offsets"])
        if info.get("target_offsets"):
            self.target_offsets = offsets_of(info["target_offsets"])
        else:  # the run's target: what the log held when it started (progress is measured against it)
            try:
                self.target_offsets = self._run_target()
            except Exception as exc:  # noqa: BLE001 - Kafka unreachable: progress falls back to the log end
                log.warning("%s: cannot read the run's target offsets: %s", self.view.ref, one_line(exc))
            if self.target_offsets is not None:
                info["target_offsets"] = {str(p): o for p, o in self.target_offsets.items()}
                save_run_info(self.paths.checkpoint, info, files=self._files)
        self._run_info = info
        if self.paths.is_local:  # progress before the first batch of this driver: what earlier ones committed
            topic = self.settings.topic(self.view.stream_topic)
            self.processed_offsets.update(last_commit(f"{self.paths.checkpoint}/main", topic)[0])

    def _run_target(self) -> dict[int, int]:
        """Where this run is complete: the offsets at a bounded run's end timestamp, else the log end now."""
        from kappa.log.topics import offsets_for_timestamp, partition_offsets

        topic = self.settings.topic(self.view.stream_topic)
        if self.end_timestamp_ms is not None:
            return offsets_for_timestamp(self.settings, topic, self.end_timestamp_ms)
        return {p: high for p, (_low, high) in partition_offsets(self.settings, topic).items()}

    def _remember_target_reached(self) -> None:
        """Record in run.json, once per run, when its committed batches first reached the run's target (the time a
        replay took, start-up included, for later replays' ETA: :func:`kappa.control.replay.planning.measured_throughput`;
        its caught-up state is only recorded when something samples it)."""
        if ("target_reached_at" in self._run_info or not self.target_offsets or self.start_offsets is None
                or any(self.processed_offsets.get(p, -1) < o for p, o in self.target_offsets.items())):
            return
        from datetime import UTC, datetime

        self._run_info["target_reached_at"] = datetime.now(UTC).isoformat()
        try:
            save_run_info(self.paths.checkpoint, self._run_info, files=self._files)
        except Exception as exc:  # noqa: BLE001 - a measurement for ETAs, never worth a batch
            log.warning("%s: cannot record when the run reached its target: %s", self.view.ref, one_line(exc))

    def _remember_start(self, offsets: dict[int, int]) -> None:
        """Record the run's start offsets in run.json, once per run (progress is measured from them to the
        run's target: :func:`kappa.runtime.checkpoint.run_progress`)."""
        if self.start_offsets is None:
            self.start_offsets = dict(offsets)
            self._run_info["start_offsets"] = {str(p): o for p, o in offsets.items()}
            save_run_info(self.paths.checkpoint, self._run_info, files=self._files)

    # ---------------------------------------------------------------------------------------------------
    def start(self, *, wait_for_topics: bool = False) -> "ViewJob":
        """Take the driver lock, create the tables, start the queries and the metrics endpoint.

        ``wait_for_topics``: a topic the view reads that does not exist yet is waited for, with the metrics endpoint
        already up (the driver is alive: in a cluster the topics Job runs only once the release's pods are Ready,
        so a driver that exited instead would never let it run); otherwise the start fails.
        """
        if self._lock is not None:
            self._lock.acquire()
        try:
            if self._lease is not None:
                self._lease.acquire()
            if wait_for_topics:
                self._wait_for_topics()
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def topics(self) -> list[str]:
        """The topics the view reads: its stream and the topics of its lookups."""
        return sorted({self.settings.topic(self.view.stream_topic),
                       *(self.settings.topic(lookup.topic) for lookup in self.view.lookups.values())})

    def missing_topics(self) -> list[str]:
        """The topics the view reads that do not exist yet (all of them while the broker cannot be reached); each
        is shown as ``kappa_waiting_for_topic{topic} 1`` on the metrics endpoint while it is missing."""
        from kappa.log.topics import list_topics

        try:
            have = set(list_topics(self.settings, timeout=10.0))
        except Exception:  # noqa: BLE001 - a broker still starting: every topic counts as missing
            have = set()
        missing = [topic for topic in self.topics if topic not in have]
        self._mark_waiting(missing)
        return missing

    def _mark_waiting(self, missing: list[str]) -> None:
        for topic in self.topics:
            self.metrics.g(self.metrics.waiting_for_topic, topic=topic).set(1 if topic in missing else 0)

    def serve_metrics(self) -> int | None:
        """Bind the metrics endpoint now (before the query starts: a driver waiting for its topics is alive and
        says what it waits for); :meth:`start` keeps it."""
        if self.metrics_port is not None and self.bound_port is None:
            self.bound_port = self.metrics.serve(self.metrics_port, addr=self.settings.metrics_addr)
        return self.bound_port

    def _wait_for_topics(self) -> None:
        from kappa.log.topics import wait_for_topics

        self.serve_metrics()
        # the gauges follow what is missing at each poll (the readiness of a pod says what its driver waits for)
        wait_for_topics(self.settings, self.topics, say=lambda line: log.warning("%s: %s", self.view.ref, line),
                        alive=self.missing_topics)
        self._mark_waiting([])

    def _start(self) -> None:
        self._prepare_run()
        self._refuse_old_layout()
        view = self.view
        # the lookups' data is read while the tables are created: the plans need their DataFrames, not their rows
        lookups = self.lookups.frames(view.lookups, read=False)
        archived = self._archive_stream(lookups)
        if archived is None:
            self._stream, output_schema = self._plan(self._decoded_stream(), lookups)
        else:  # the view's own query plans once the archive part is done, if it starts at all
            self._stream, output_schema = None, archived[1]
        with ThreadPoolExecutor(1, thread_name_prefix=f"lookups-{view.name}") as pool:
            reading = pool.submit(self.lookups.read, view.lookups.values())
            self._create_tables(output_schema)
            reading.result()
        seed = self._run_info.get("seed")
        if seed and seed_table(self.spark, self.paths.table, seed, self.app_id or ""):
            log.info("%s: table seeded with v%s's rows at Delta version %s (upgrade=continue from %s)", view.ref,
                     seed.get("from_version"), seed.get("delta_version"), seed.get("end_offsets"))
        # a seeded table holds rows already: its first batches merge into them instead of bulk-appending
        self.sink = DeltaSink(view, self.paths.table, self.app_id or "", staging=None if seed else self.paths.staging,
                              fresh=not batch_ids(f"{self.paths.checkpoint}/main/offsets"),
                              stage_rows=self.available_now and view.stateful,
                              live_rs=self.settings.live_commits == "delta-rs")
        self.handler = BatchHandler(view=view, sink=self.sink,
                                    quarantine=QuarantineSink(view, self.paths.quarantine, f"{self.app_id}/quarantine"),
                                    metrics=self.metrics, lookups=self.lookups, lineage=self._lineage,
                                    catching_up=self._catching_up, output_columns=list(output_schema.fieldNames()),
                                    late_rows=self._late_rows, records=self._batch_records,
                                    topic=self.settings.topic(view.stream_topic),
                                    fault=self.settings.fault,
                                    guard=self._lease.check if self._lease is not None else _no_guard)
        self._settle()  # a restart ends bulk catch-up: what an earlier driver staged goes into the table now

        if self.metrics_port is not None and self.bound_port is None:
            self.bound_port = self.metrics.serve(self.metrics_port, addr=self.settings.metrics_addr)
            log.info("%s metrics on http://127.0.0.1:%s/metrics", view.ref, self.bound_port)
        self._install_listener()
        complete = self._from_archive(archived[0] if archived is not None else None)
        if self._stop.is_set():
            return
        if complete and self.available_now:
            # the archive part read the log up to its end when it started: a bounded run is done (a live one goes on
            # with the view's own query)
            log.info("%s: the run's range is committed; nothing left for the view's query", view.ref)
            self._settle()
        else:
            self.queries = [self._start_query()]
        if view.publish is not None:  # views over this one read what it publishes (kappa.runtime.publish)
            from kappa.runtime.publish import Publisher

            self.publisher = Publisher(view, self.settings, self.paths, files=self._files, metrics=self.metrics)
            self.publisher.ensure_topic()
            self.publisher.start(self.trigger_seconds)
        self._lag_thread = threading.Thread(target=self._poll_lag, name=f"lag-{view.ref}", daemon=True)
        self._lag_thread.start()
        threading.Thread(target=self._poll_reading, name=f"reading-{view.ref}", daemon=True).start()
        from kappa.runtime.repairs import WINDOW_START, RepairInbox

        if not self.paths.is_local and view.finality is not None and WINDOW_START in view.keys:
            # on an object store a repair's swap is committed here, in this JVM, between this job's own commits:
            # one Spark writer per table (kappa.runtime.repairs; only views with windows can be repaired)
            self.repairs = RepairInbox(self.spark, self.paths.root, self.paths.table, self._files,
                                       self.handler.commit_lock, applied_by=self.app_id or "", ref=view.ref)
            threading.Thread(target=self.repairs.run, args=(self._stop, self.lag_poll_seconds),
                             name=f"repairs-{view.ref}", daemon=True).start()
        if not self.available_now:  # a live table keeps itself: compaction, VACUUM (kappa.runtime.upkeep)
            self._start_keeper()

    def _create_tables(self, output_schema: Any) -> None:
        """The view table (with the run's properties, change data feed on) and the shared quarantine, if missing."""
        if create_view_tables(self.spark, self.view, output_schema, self.paths.table, self.paths.quarantine,
                              self.run_id or "", history_hours=self.settings.table_history_hours):
            log.info("%s: change data feed turned on for %s", self.view.ref, self.paths.table)

    def _start_keeper(self) -> None:
        """The thread that keeps this version's table (:class:`kappa.runtime.upkeep.TableKeeper`): an archive's
        retention first (:func:`kappa.runtime.archive.keep`), compaction under the commit lock, then VACUUM beside
        the job's commits (a full one at the first upkeep and once a day), then its quarantine partition."""
        import functools

        from kappa.runtime.upkeep import FULL_VACUUM_SECONDS, TableKeeper, Upkept, compact, compact_quarantine

        lock = self.handler.commit_lock
        if self.view.keep_invalid:  # an archive: its declared retention too, never under a replay's lease
            from kappa.catalog import load_catalog
            from kappa.runtime.archive import keep, replay_leases

            spec = load_catalog().views.get(self.view.name)
            topic = self.settings.topic(self.view.stream_topic)
            table_step = functools.partial(keep, self.spark, self.paths.table, lock=lock,
                                           retention_ms=spec.retention_ms if spec is not None else None,
                                           holds=lambda: replay_leases(self.settings, topic))
            what = "archive upkeep"
        else:
            def table_step(full_vacuum: bool) -> Any:
                return compact(self.spark, self.paths.table, lock=lock, full_vacuum=full_vacuum,
                               hold=self._history_held)
            what = "upkeep"
        quarantine = rs_uri(self.paths.quarantine)
        last_full: float | None = None  # when the last full VACUUM ran (the first upkeep's is one)

        def both() -> Any:
            nonlocal last_full
            full = last_full is None or time.monotonic() - last_full >= FULL_VACUUM_SECONDS
            done = Upkept(table_step(full_vacuum=full), compact_quarantine(quarantine, self.view.name))
            if full:
                last_full = time.monotonic()
            return done

        self.keeper = TableKeeper(self.view.ref, both, what=what,
                                  between=self._compactions(lock) if self.settings.compact_files > 0 else None)
        threading.Thread(target=self.keeper.run, args=(self._stop, self.settings.upkeep_seconds),
                         name=f"upkeep-{self.view.ref}", daemon=True).start()

    def _compactions(self, lock: Any) -> Callable[[], Any]:
        """The keeper's look between upkeeps (:func:`kappa.runtime.upkeep.compact_between`): the table - not an
        archive's (a micro-batch every 30 s, its retention hourly) - and the view's partition of the quarantine."""
        import functools

        from kappa.runtime.upkeep import compact_between

        return functools.partial(compact_between, self.spark, self.paths.table, rs_uri(self.paths.quarantine),
                                 self.view.name, limit=self.settings.compact_files, lock=lock,
                                 table_too=not self.view.keep_invalid, handles={},
                                 clean=self.settings.table_history_hours is not None, hold=self._history_held)

    def _history_held(self) -> bool:
        """Whether the table's history must stay for now: this version's publisher is more than
        :data:`PUBLISH_HOLD_COMMITS` commits behind it (the change data it has still to read is not VACUUMed, nor
        the log that points to it cleaned, whatever the history's length)."""
        return self.publisher is not None and self.publisher.behind() > PUBLISH_HOLD_COMMITS

    def _plan(self, decoded: "DataFrame", lookups: Mapping[str, "DataFrame"]) -> tuple["DataFrame", Any]:
        """(the streaming plan over ``decoded`` records, the schema of the rows it writes)."""
        view = self.view
        if view.stateful:
            # the transform runs in the streaming plan (Spark keeps its state); bad records travel beside it
            partitions = int(self.spark.conf.get("spark.sql.shuffle.partitions"))
            stream = stateful_plan(decoded, lambda valid: view.transform(valid, **lookups), partitions=partitions)
            return stream, stream.schema["out"].dataType
        # stateless: the streaming plan only gives the output schema; the transform runs on each batch
        from kappa.runtime.archive import archive_rows
        from kappa.runtime.parsing import valid_rows

        rows = archive_rows(decoded) if view.keep_invalid else valid_rows(decoded)
        return decoded, view.transform(rows, **lookups).schema

    def _archive_stream(self, lookups: Mapping[str, "DataFrame"]) -> tuple["DataFrame", Any] | None:
        """(the plan, the schema of the rows it writes) of a run's archive part still to run (``archive`` in
        run.json: micro-batch 0 reads ``[start, handover)`` from the topic's archive and the rest of the log, with
        the view's plan); None when the run has no archive part or it is committed."""
        from kappa.runtime import archive

        plan = self._run_info.get("archive")
        if not plan or archive.phase_done(self._files, f"{self.paths.checkpoint}/main"):
            return None
        topic = self.settings.topic(self.view.stream_topic)
        start, handover = offsets_of(plan["start"]), offsets_of(plan["handover"])
        archived = archive.archived_decoded(self.spark, plan["table"], self.view.stream_format,
                                            {p: (start.get(p, 0), h) for p, h in handover.items()}, stream=True)
        if self.end_timestamp_ms is not None:  # a bounded replay: as _decode bounds the log's records
            from pyspark.sql import functions as F

            archived = archived.where(F.col("kafka_timestamp") < F.timestamp_millis(F.lit(self.end_timestamp_ms)))
        logged = self._decode(self._read_stream(topic, starting=starting_options(
            {topic: {str(p): o for p, o in handover.items()}})))
        return self._plan(archived.unionByName(logged), lookups)

    def _from_archive(self, stream: "DataFrame | None") -> bool:
        """Run the archive part of a run that starts in the topic's archive (its start is gone from the log:
        :meth:`_archive_stream` planned it), then switch the checkpoint to the log alone
        (:mod:`kappa.runtime.archive`). Nothing to do once switched; a crash before the switch re-runs or finishes
        it. True when this call ran that micro-batch to its end (the log read up to its end at the query's
        start)."""
        from kappa.runtime import archive

        plan = self._run_info.get("archive")
        if not plan:
            return False
        ran = False
        main = f"{self.paths.checkpoint}/main"
        topic = self.settings.topic(self.view.stream_topic)
        start, handover = offsets_of(plan["start"]), offsets_of(plan["handover"])
        if stream is not None:
            log.info("%s: reading %s records of [start, handover) from the archive %s, the rest from the log",
                     self.view.ref, f"{sum(h - start.get(p, 0) for p, h in handover.items()):,}", plan["table"])
            self._remember_start(start)
            self._archive_running = True
            writer = stream.writeStream.queryName(self.archive_query_name).option("checkpointLocation", main)
            if self.view.stateful:
                writer = writer.outputMode(self.view.output_mode)
            # the range in one micro-batch, as a replay from the log reads it, then the no-data batch after it
            query = writer.trigger(availableNow=True).foreachBatch(self.handler).start()
            self.queries = [query]
            try:
                query.awaitTermination()
            finally:
                self._archive_running = False
            self.queries = []
            if self._stop.is_set() or not archive.phase_done(self._files, main):
                return False
            ran = True
        fault(self.settings.fault, "before_switch", 0)  # crash tests: batch 0 committed, checkpoint not switched
        self._offset_texts.clear()  # the switch rewrites the offset log's entries
        if archive.switch_checkpoint(self._files, main, topic, start):
            log.info("%s: the archive part is committed; the view's query goes on from the log", self.view.ref)
        if self.paths.is_local:
            self.processed_offsets.update(last_commit(main, topic)[0])
            self._remember_target_reached()
        return ran

    def _refuse_old_layout(self) -> None:
        """A checkpoint with a separate quarantine query (older layout) cannot be resumed by one query."""
        if self.paths.is_local and self.paths.local("quarantine").is_dir():
            raise RunMismatch(
                f"{self.view.ref}: checkpoint {self.paths.checkpoint} was written by an older kappa that ran a "
                "second query for the quarantine; replay this view into a new version (or remove the version's "
                "table and checkpoint to rebuild it)")

    def _start_query(self) -> "StreamingQuery":
        if self._stream is None:  # planned only now: the run's archive part ran first
            self._stream = self._plan(self._decoded_stream(), self.lookups.frames(self.view.lookups))[0]
        writer = self._stream.writeStream.queryName(self.query_name).option(
            "checkpointLocation", f"{self.paths.checkpoint}/main")
        if self.view.stateful:
            writer = writer.outputMode(self.view.output_mode)
        if self.available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{int(self.trigger_seconds * 1000)} milliseconds")
        self.metrics.g(self.metrics.trigger_seconds).set(0.0 if self.available_now else self.trigger_seconds)
        return writer.foreachBatch(self.handler).start()

    def recover(self) -> bool:
        """Restart the query if it died of a known, harmless Spark failure; False if the failure is real.

        Spark 4.1's Kafka source throws a NullPointerException while *reporting progress* of the first batch
        after a restart when that batch is re-run from the offset log (SPARK-55271). The batch and its
        checkpoint commit are complete by then, so starting the query again on the same checkpoint is safe.
        """
        query = self.queries[0] if self.queries else None
        message = str(query.exception()) if query is not None and query.exception() is not None else ""
        if not message or _SPARK_55271 not in message or self._recoveries >= 10:
            return False
        self._recoveries += 1
        log.warning("%s: restarting its query after SPARK-55271 (progress-reporting NPE)", self.view.ref)
        self.queries[0] = self._start_query()
        return True

    @property
    def _files(self) -> Any:
        """How the job reads and writes its checkpoint's own files: directly on a local lake, through Spark's
        Hadoop file system elsewhere (the store's credentials are the session's)."""
        if self.paths.is_local:
            from kappa.runtime import checkpoint

            return checkpoint.LAKE_FILES
        from kappa.runtime.spark import HadoopFiles

        return HadoopFiles(self.spark)

    def _checkpoint_text(self, spark: "SparkSession", name: str) -> str | None:
        """A file of the query's checkpoint (``offsets/<id>``, ``sources/0/0``) through Hadoop FS (any store).

        The offset log's last few entries are kept: Spark writes each once, before its micro-batch, and a batch
        reads its own and the one before for its record count, its lineage and its late rows."""
        from kappa.runtime.spark import HadoopFiles

        if name in self._offset_texts:
            return self._offset_texts[name]
        text = HadoopFiles(spark).read(f"{self.paths.checkpoint}/main/{name}")
        if text is not None and name.startswith("offsets/"):
            self._offset_texts[name] = text
            while len(self._offset_texts) > 4:
                del self._offset_texts[next(iter(self._offset_texts))]
        return text

    def _catching_up(self, spark: "SparkSession", batch_id: int) -> bool:
        """Did micro-batch ``batch_id`` stop at ``maxOffsetsPerTrigger`` while more of the log is already there?

        Read from the offset log (this batch's end offsets minus the previous batch's, or the query's initial
        offsets) and the topic's end offsets now. Without a micro-batch bound every batch reads all there is.
        """
        if not self.max_offsets_per_trigger:
            return False
        try:
            return self._stopped_at_bound(spark, batch_id)
        except Exception as exc:  # noqa: BLE001 - not knowing is safe: the batch is written to the table
            log.warning("%s: batch %s: cannot tell whether it is a catch-up batch (%s); writing it to the table",
                        self.view.ref, batch_id, one_line(exc))
            return False

    def _stopped_at_bound(self, spark: "SparkSession", batch_id: int) -> bool:
        from kappa.log.topics import partition_offsets

        start, end, _watermark = self._batch_range(spark, batch_id)
        read = sum(max(0, o - start.get(p, o)) for p, o in end.items())
        # Spark prorates the bound over the partitions, rounding each share down
        if not end or read < self.max_offsets_per_trigger - len(end):
            return False
        topic = self.settings.topic(self.view.stream_topic)
        return any(high > end.get(p, high) for p, (_low, high) in partition_offsets(self.settings, topic).items())

    def _initial_offsets(self, topic: str) -> dict[int, int] | None:
        """The offsets the query started from (``sources/0/0`` of its checkpoint: ``v1`` then JSON)."""
        try:
            text = self._checkpoint_text(self.spark, "sources/0/0") or ""
            first = json.loads(text.splitlines()[-1]) if text.strip() else {}
            return {int(p): int(o) for p, o in (first.get(topic) or {}).items()} or None
        except Exception as exc:  # noqa: BLE001 - progress falls back to the first batch's end offsets
            log.warning("%s: cannot read the query's initial offsets: %s", self.view.ref, one_line(exc))
            return None

    def _batch_range(self, spark: "SparkSession", batch_id: int) -> tuple[dict[int, int], dict[int, int], int]:
        """Micro-batch ``batch_id`` from the offset log: (start offsets, end offsets, the watermark of the
        previous batch - the one Spark drops this batch's late rows by; 0 for the query's first batch)."""
        topic = self.settings.topic(self.view.stream_topic)
        end = parse_offset_log(self._checkpoint_text(spark, f"offsets/{batch_id}") or "", topic)[0]
        previous_text = self._checkpoint_text(spark, f"offsets/{batch_id - 1}") if batch_id > 0 else None
        if previous_text is not None:
            start, watermark = parse_offset_log(previous_text, topic)
        else:  # the first batch of the query: its initial offsets ("v1" then JSON, no watermark line)
            first = json.loads((self._checkpoint_text(spark, "sources/0/0") or "{}").splitlines()[-1] or "{}")
            start, watermark = {int(p): int(o) for p, o in (first.get(topic) or {}).items()}, 0
        return start, end, watermark

    def _batch_records(self, spark: "SparkSession", batch_id: int) -> int | None:
        """Records of the log micro-batch ``batch_id`` reads, from the offset log; None when not known (a partition
        without a start, the offset log unreadable, a run's archive part - it reads the archive table too)."""
        if self._archive_running:
            return None
        try:
            start, end, _watermark = self._batch_range(spark, batch_id)
        except Exception as exc:  # noqa: BLE001 - only how many tasks read the batch depends on it
            log.debug("%s: batch %s: records unknown (%s)", self.view.ref, batch_id, one_line(exc))
            return None
        if not end or any(p not in start for p in end):
            return None
        return sum(max(0, o - start[p]) for p, o in end.items())

    def _late_rows(self, spark: "SparkSession", batch_id: int) -> "DataFrame | None":
        """The records of micro-batch ``batch_id`` that its watermark dropped, to keep (:mod:`kappa.runtime.late`);
        None when the view does not keep them or the batch dropped none."""
        if self.view.late_bound is None or dropped_by_watermark(self.spark, self.query_name) == 0:
            return None
        start, end, watermark = self._batch_range(spark, batch_id)
        if not watermark or not end:
            return None
        self.late_batches.append(batch_id)
        topic = self.settings.topic(self.view.stream_topic)
        raw = (spark.read.format("kafka").options(**self._kafka_options())
               .option("assign", json.dumps({topic: sorted(end)}))
               .option("startingOffsets", json.dumps({topic: {str(p): start.get(p, -2) for p in end}}))
               .option("endingOffsets", json.dumps({topic: {str(p): o for p, o in end.items()}}))
               .option("failOnDataLoss", "false" if self.view.stream_format.tombstones else "true").load())
        return late_records(self._decode(raw), self.view.late_bound(), watermark)

    def _settle(self) -> None:
        """Compact what bulk catch-up staged and has not yet written to the view table (restart, bounded end)."""
        batch_id = self.sink.pending(self.spark)
        if batch_id is not None:
            log.info("%s: writing the staged catch-up batches (up to %s) to the view table", self.view.ref, batch_id)
            self.sink.compact(self.spark, batch_id, self._lineage(self.spark, batch_id))

    def _lineage(self, spark: "SparkSession", batch_id: int) -> str | None:
        """The batch's log range and watermark from the query's offset log (written before the batch runs), and
        the offsets of the lookups it joined, as the Delta commit's ``userMetadata`` (:mod:`kappa.runtime.lineage`)."""
        try:
            text = self._checkpoint_text(spark, f"offsets/{batch_id}")
            if text is None:
                raise FileNotFoundError(f"offsets/{batch_id}")
        except Exception as exc:  # noqa: BLE001 - lineage is for audits; the commit itself must go on
            log.warning("%s: batch %s: cannot read its offset log for the commit's lineage: %s", self.view.ref,
                        batch_id, one_line(exc))
            return None
        topic = self.settings.topic(self.view.stream_topic)
        offsets, watermark = parse_offset_log(text, topic)
        return batch_metadata(app_id=self.app_id or "", batch_id=batch_id, topic=topic, end_offsets=offsets,
                              watermark_ms=watermark,
                              lookups={name: self.lookups.offsets(lookup) for name, lookup in self.view.lookups.items()})

    # progress, lag -------------------------------------------------------------------------------------
    def _install_listener(self) -> None:
        """Follow the progress of this job's queries (:meth:`_on_progress`).

        Every listener of a session gets every query's events, and PySpark turns each event into Python objects
        field by field before a listener sees it - dozens of calls into the JVM per event and listener, made on
        Spark's one ``streams`` listener thread: with six views in the view host that thread used a third of a core
        at 200 events/s. This listener asks the event for its query's name (one call), skips other queries' events
        and reads its own as one JSON document (:class:`ProgressListener`)."""
        job = self

        def progress(event: Any) -> None:
            with job._batch_ended:  # a micro-batch committed: a stop waiting for it may go on
                job._batches_ended += 1
                job._batch_ended.notify_all()
            try:
                job._on_progress(event)
            except Exception:  # metrics must never break the query
                log.exception("progress handling failed")

        self._listener = ProgressListener({self.query_name, self.archive_query_name}, progress,
                                          on_terminated=self._terminated.set)
        self.spark.streams.addListener(self._listener)

    def _on_progress(self, progress: Any) -> None:
        m = self.metrics
        self._last_batch = progress.batchId
        m.g(m.input_rate).set(progress.inputRowsPerSecond or 0.0)
        m.g(m.processed_rate).set(progress.processedRowsPerSecond or 0.0)
        m.g(m.input_rows).inc(progress.numInputRows or 0)
        durations = progress.durationMs or {}
        duration = durations.get("triggerExecution")
        if duration is not None and progress.numInputRows:
            m.batch_duration.labels(**m.labels).observe(duration / 1000.0)
        if duration is not None and not self.available_now:
            change = self._pace.batch(duration / 1000.0, self.trigger_seconds)
            m.g(m.falling_behind).set(int(self._pace.behind))
            if change:
                log.log(logging.WARNING if self._pace.behind else logging.INFO, "%s: %s", self.view.ref, change)
        # Spark's own phases of the batch, beside ours (kappa.runtime.batch): planning, offsets, offset/commit logs
        for phase, keys in SPARK_PHASES.items():
            seconds = sum(float(durations.get(k) or 0) for k in keys) / 1000.0
            m.g(m.phase_seconds, phase=phase).set(seconds)
            if getattr(self, "handler", None) is not None:
                self.handler.times.add(phase, seconds)
        watermark = (progress.eventTime or {}).get("watermark")
        if watermark and not watermark.startswith("1970-01-01"):
            from datetime import datetime

            wm = datetime.fromisoformat(watermark.replace("Z", "+00:00")).timestamp()
            m.g(m.watermark_delay).set(max(0.0, time.time() - wm))
        dropped = sum(getattr(op, "numRowsDroppedByWatermark", 0) or 0 for op in progress.stateOperators or [])
        m.g(m.rows_dropped_late).set(dropped)
        if dropped:
            m.g(m.late_dropped).inc(dropped)
        for source in progress.sources or []:
            end = _offsets_json(source.endOffset) or {}
            start = _offsets_json(source.startOffset)
            topic = self.settings.topic(self.view.stream_topic)
            offsets = {int(p): int(o) for p, o in end.get(topic, {}).items()}
            if start and self.start_offsets is None:
                first = {int(p): int(o) for p, o in start.get(topic, {}).items()}
                self._remember_start(first)
            elif self.start_offsets is None and offsets and progress.numInputRows:
                # the query's first batch reports no start: it began at the initial offsets in its checkpoint
                initial = self._initial_offsets(topic)
                self._remember_start(initial if initial is not None else {p: o for p, o in offsets.items()})
            self.processed_offsets.update(offsets)
            self._remember_target_reached()

    def _next_batch(self) -> int:
        """The id of the main query's micro-batch that runs now or next."""
        if self._last_batch is None:
            committed = batch_ids(f"{self.paths.checkpoint}/main/commits")
            self._last_batch = max(committed) if committed else -1
        return self._last_batch + 1

    def _poll_reading(self, period: float = 1.0, log_every: float = 10.0) -> None:
        """In-batch progress of a long micro-batch (:mod:`kappa.runtime.inflight`): ``kappa_batch_records_read``,
        and a line in the job's log every ``log_every`` s while it reads."""
        from kappa.runtime.inflight import ReadTracker

        tracker: ReadTracker | None = None
        logged: tuple[int, float, bool] | None = None
        m = self.metrics
        while not self._stop.wait(period):
            try:
                run_id = str(self.queries[0].runId)  # a recovered query has a run id (job group) of its own
                if tracker is None or tracker.group != run_id:
                    tracker = ReadTracker(self.spark.sparkContext.statusTracker(), run_id, next_batch=self._next_batch,
                                          batch_range=lambda b: self._batch_range(self.spark, b)[:2])
                reading = tracker.sample()
            except Exception as exc:  # noqa: BLE001 - a progress estimate; the batch itself goes on
                log.debug("%s: in-batch progress unavailable: %s", self.view.ref, one_line(exc))
                reading = None
            self._reading = reading
            m.g(m.batch_read).set(reading.read if reading is not None else 0)
            if reading is not None and (logged is None or logged[0] != reading.batch_id
                                        or (not logged[2] and (reading.complete
                                                               or time.monotonic() - logged[1] >= log_every))):
                log.info("%s: %s", self.view.ref, reading.summary())  # while it reads, and once when read
                logged = (reading.batch_id, time.monotonic(), reading.complete)

    def _poll_lag(self) -> None:
        from kappa.log.topics import recent_partition_offsets

        m = self.metrics
        topic = self.settings.topic(self.view.stream_topic)
        reached = time.time()
        rs_table = None  # the table's log through delta-rs, brought up to date at each poll (opened once)
        version_error = ""
        while not self._stop.wait(self.lag_poll_seconds):
            try:
                # the jobs of a view host reading one topic share one answer per poll period
                ends = recent_partition_offsets(self.settings, topic, max_age=self.lag_poll_seconds / 2,
                                                timeout=max(5.0, self.lag_poll_seconds))
            except Exception as exc:  # Kafka unreachable: keep the last values, say so (metrics and log)
                m.g(m.kafka_reachable).set(0)
                m.g(m.kafka_unreachable_seconds).set(time.time() - reached)
                log.warning("%s: Kafka unreachable for %.0f s (the job waits for it): %s", self.view.ref,
                            time.time() - reached, one_line(exc))
                continue
            reached = time.time()
            m.g(m.kafka_reachable).set(1)
            m.g(m.kafka_unreachable_seconds).set(0)
            total_lag = 0
            reading = self._reading  # a long micro-batch running now: what its read tasks got through
            # before the run's first commit, a running first batch starts where the run does
            done_offsets = self.processed_offsets or (dict(reading.start) if reading is not None else {})
            for partition, (low, high) in ends.items():
                processed = done_offsets.get(partition, low if done_offsets else None)
                p = str(partition)
                m.g(m.log_end, topic=topic, partition=p).set(high)
                if processed is None:
                    continue
                lag = max(0, high - processed)
                total_lag += lag
                m.g(m.lag, topic=topic, partition=p).set(lag)
                m.g(m.processed_offset, topic=topic, partition=p).set(processed)
            try:  # off the batch path: delta-rs reads the table's new commits, no Spark job
                if rs_table is None:
                    from deltalake import DeltaTable as _RsTable

                    rs_table = _RsTable(self.paths.table.removeprefix("file:"))
                else:
                    rs_table.update_incremental()
                m.g(m.last_delta_version).set(rs_table.version())
            except Exception as exc:  # noqa: BLE001 - a metric; the table may not exist yet
                rs_table = None
                if (why := one_line(exc)) != version_error:  # once per cause, not every poll
                    log.warning("%s: kappa_last_delta_version unavailable: %s", self.view.ref, why)
                    version_error = why
            if done_offsets:
                start = self.start_offsets or done_offsets
                target = self.target_offsets or {p: high for p, (_low, high) in ends.items()}
                counted = run_progress(start, target, done_offsets)
                rate = m.g(m.processed_rate)._value.get()
                if reading is not None and counted.total and reading.rate:
                    # not done before the batch commits: short of 1.0 and at least a second left; once read, what
                    # is left (state, the Delta commit) takes a time nothing here measures - unknown (inf), not 0
                    ratio = min(0.999, (counted.done + reading.read) / counted.total)
                    eta = (float("inf") if reading.complete
                           else max(1.0, (total_lag - reading.read) / reading.rate))
                else:  # caught up (the run's target reached): what remains is the live stream's lag, not a wait
                    ratio = counted.ratio
                    eta = (0.0 if ratio >= 1.0 or total_lag == 0 else
                           total_lag / rate if rate > 0 else float("inf"))
                m.g(m.progress).set(ratio)
                m.g(m.eta).set(eta)

    # lifecycle -----------------------------------------------------------------------------------------
    def process_all_available(self) -> None:
        """Block until every query has processed all data available now and its commits are published (tests)."""
        for query in self.queries:
            query.processAllAvailable()
        if self.publisher is not None:
            self.publisher.publish()

    def await_termination(self, timeout: float | None = None) -> bool:
        """Wait for the queries to end (bounded runs end by themselves); re-raise a query failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for query in self.queries:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    if remaining is None:
                        query.awaitTermination()
                    elif not query.awaitTermination(remaining):
                        return False
                except Exception:  # the query failed: recover if harmless, else report via failure()
                    break
            if self.failure() and self.recover():
                continue
            if self.available_now and self.failure() is None and getattr(self, "sink", None) is not None:
                self._settle()  # a bounded run that ended on a staged batch: its rows belong in the table now
            return True

    def ended_maybe(self) -> bool:
        """Whether a query of this job may have failed or ended since the last call that said True: the session's
        listener saw a query terminate (any query's), or :data:`FULL_CHECK_SECONDS` passed since then (a listener
        event can be dropped when Spark's listener queue overflows).

        Asking each query for its failure and its state (:meth:`failure`, ``isActive``) is several calls into the
        JVM, and their objects' release as many more; a host that asked each of six versions every second spent a
        fifth of its Python's time on it (docs/performance.md). The listener's event makes the usual case cost
        nothing."""
        now = time.monotonic()
        if self._terminated.is_set() or now >= self._next_full_check:
            self._terminated.clear()  # before the caller looks: a query ending while it looks sets it again
            self._next_full_check = now + FULL_CHECK_SECONDS
            return True
        return False

    def failure(self) -> str | None:
        """The first query failure message, if any query died: the Python error raised in ``foreachBatch`` when
        there is one (e.g. a ``fail`` expectation), not the JVM's wrapper around it."""
        for query in self.queries:
            exc = query.exception()
            if exc is not None:
                return failure_line(str(exc))
        return None

    def run_forever(self, on_tick: Callable[["ViewJob"], None] | None = None) -> None:
        """Run until SIGTERM/SIGINT (live) or until a bounded run ends; re-raise a query failure.

        A failed query is started again from its checkpoint in this process, as the view host restarts its
        versions: after ``KAPPA_HOST_RESTART_BACKOFF_SECONDS`` doubling with each consecutive failure (counted from
        zero again after :data:`kappa.runtime.host.HEALTHY_SECONDS` without one), at most
        ``KAPPA_HOST_MAX_RESTARTS`` in a row; the next failure is raised (the driver exits 1, its pod restarts).
        Meanwhile the metrics endpoint stays up: ``kappa_batches_failed_total`` counts every failed micro-batch
        where Prometheus scrapes it, instead of dying with a process that ended right after the failure.
        """
        from kappa.runtime.host import HEALTHY_SECONDS, restart_delay

        signalled = threading.Event()
        failures, healthy_since = 0, time.monotonic()

        def _term(signum: int, _frame: Any) -> None:
            log.info("signal %s: stopping %s", signum, self.view.ref)
            signalled.set()
            self._stop.set()

        signal.signal(signal.SIGTERM, _term)
        signal.signal(signal.SIGINT, _term)
        try:
            while not self._stop.is_set():
                if self.ended_maybe():
                    if failure := self.failure():
                        if self.recover():
                            continue
                        if time.monotonic() - healthy_since > HEALTHY_SECONDS:
                            failures = 0
                        failures += 1
                        # a lease another driver took is not given back by a restart of this one's query
                        if failures > self.settings.host_max_restarts or "DriverLeaseLost" in failure:
                            break
                        delay = restart_delay(self.settings.host_restart_backoff_seconds, failures)
                        log.error("%s failed (%s of %s): %s; restarting it from its checkpoint in %.0f s",
                                  self.view.ref, failures, self.settings.host_max_restarts, failure, delay)
                        if self._stop.wait(delay):
                            break
                        self.queries[0] = self._start_query()
                        healthy_since = time.monotonic()
                        continue
                    if all(not q.isActive for q in self.queries):
                        break
                if on_tick:
                    on_tick(self)
                self._stop.wait(1.0)
            failure = None if signalled.is_set() else self.failure()
            if failure:
                raise RuntimeError(f"{self.view.ref} failed: {failure}")
        finally:
            self.stop()

    def stop(self, *, drain_seconds: float | None = None) -> None:
        """Stop the queries (each between two micro-batches when possible), the metrics server and Spark.

        A query is stopped once its current micro-batch finished (up to ``drain_seconds``, default
        ``KAPPA_STOP_DRAIN_SECONDS``, 45 s: the local runner kills after 60 s, the chart's
        terminationGracePeriodSeconds is 120): interrupting a batch
        is safe - the checkpoint and the idempotent Delta commit make the re-run exact - but wastes its work.
        """
        self._stop.set()
        ended = bool(self.queries) and all(not q.isActive for q in self.queries) and self.failure() is None
        deadline = time.monotonic() + (self.settings.stop_drain_seconds if drain_seconds is None else drain_seconds)
        with self._batch_ended:
            seen = self._batches_ended
        from kappa.runtime.spark import stopping_queries

        with stopping_queries(self._spark if self.queries else None):
            for query in self.queries:
                try:
                    # the micro-batch running now commits (its progress event), or none runs; a live stream on a
                    # busy machine starts the next batch at once, so "no trigger active" alone may never be seen
                    while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
                        with self._batch_ended:
                            if self._batches_ended > seen and query.name == self.query_name:
                                break
                            self._batch_ended.wait(0.05)
                    query.stop()
                except Exception:  # already stopped or the JVM is gone
                    pass
        if ended and getattr(self, "sink", None) is not None:
            try:  # a bounded run that ended on a catch-up batch: its staged rows belong in the table
                self._settle()
            except Exception as exc:  # noqa: BLE001 - the next start settles again; say why it did not now
                log.error("%s: staged catch-up batches not written yet: %s", self.view.ref, exc)
        if self.publisher is not None:  # what the last commits (and the settle) added is published too
            self.publisher.stop(final=True)
            self.publisher = None
        if self._listener is not None:
            try:
                self.spark.streams.removeListener(self._listener)
            except Exception:
                pass
            self._listener = None
        self.metrics.close()
        if self._lookup_cache is not None and self._own_lookups:
            self._lookup_cache.close()
            self._lookup_cache = None
        if self._lease is not None:
            self._lease.release()
        if self._lock is not None:
            self._lock.release()
        if self._own_spark and self._spark is not None:
            from kappa.runtime.spark import stop_spark

            try:
                stop_spark(self._spark)
            except Exception:  # the JVM is already gone (e.g. the whole process group got SIGTERM)
                pass
            self._spark = None
