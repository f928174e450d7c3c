"""Views of views (Samza's pattern): a view version publishes rows of its table to a Kafka topic other views read.

A version declares ``publish=Publish(topic=..., key=(...), where="is_final", order_by=(...))``
(:class:`kappa.runtime.view.Publish`). Its job runs a :class:`Publisher` beside the streaming query: every
trigger, the rows the table's new Delta commits inserted or updated that match ``where`` are read from the
table's change data feed (delta-rs, no Spark job) and produced to the topic - keyed by ``key`` (a compacted
topic keeps the latest record per key), sorted by ``order_by``, as JSON with timestamps in epoch milliseconds.
The first publish of a version (no progress yet) publishes its table's snapshot instead, so a version declaring
``publish`` later still publishes everything it holds.

**Delivery: at least once, identical copies.** Progress (the last Delta version published) is written to
``<checkpoint>/publish.json`` after every record of a range is acknowledged (idempotent, ``acks=all`` producer).
A crash in between publishes that range again: the same keys with the same values, because a published row
(a final window) never changes. A reader dropping copies by key within its watermark, or upserting by key,
counts each row once. The job's table stays the version's truth; the topic is its published log.

**Order.** Rows are produced in ``order_by`` order within a range, and ranges in commit order. For windows
published when final, later commits only finalize later windows, so a one-partition topic carries them in
event-time order: a downstream watermark drops nothing but copies.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from kappa.errors import one_line
from kappa.runtime.checkpoint import LAKE_FILES

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.identity import ViewPaths
    from kappa.runtime.view import ViewDefinition

__all__ = ["PROGRESS_FILE", "Publisher", "published_through"]

log = logging.getLogger("kappa.runtime.publish")

#: The publisher's progress, in the version's checkpoint folder.
PROGRESS_FILE = "publish.json"
#: Change rows that carry a row's new content.
_NEW_IMAGES = ("insert", "update_postimage")


def published_through(checkpoint: str, *, files: Any = LAKE_FILES) -> int:
    """The last Delta version of a view version's table whose rows are published (-1: nothing yet)."""
    text = files.read(f"{checkpoint}/{PROGRESS_FILE}")
    return int(json.loads(text)["delta_version"]) if text else -1


class Publisher:
    """Publishes what a view version's table committed to its declared topic (see the module docstring).

    Args:
        view: The version (its ``publish`` declaration).
        settings: Cluster (the physical topic gets ``KAPPA_TOPIC_PREFIX``) and lake.
        paths: The version's table and checkpoint.
        files: How the checkpoint's files are read and written (a job on an object store passes Spark's).
        metrics: The job's :class:`kappa.runtime.metrics.ViewMetrics` (published rows, Delta version).
    """

    def __init__(self, view: ViewDefinition, settings: Settings, paths: ViewPaths, *, files: Any = LAKE_FILES,
                 metrics: Any = None) -> None:
        if view.publish is None:
            raise ValueError(f"{view.ref} declares no publish")
        self.view = view
        self.spec = view.publish
        self.settings = settings
        self.paths = paths
        self.files = files
        self.metrics = metrics
        self.topic = settings.topic(self.spec.topic)
        self._lock = threading.Lock()
        self._producer: Any = None  # one for the publisher's life (made at its first publish)
        self._table: Any = None  # the view table (delta-rs), brought up to date at each publish
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---------------------------------------------------------------------------------------------------
    def published_through(self) -> int:
        """The last Delta version published (-1: nothing yet)."""
        return published_through(self.paths.checkpoint, files=self.files)

    def behind(self) -> int:
        """How many commits of the table it has not published, as of its last look at the table (0 before its
        first publish, which publishes the table's rows, not its commits)."""
        table, done = self._table, self.published_through()
        return 0 if table is None or done < 0 else max(0, table.version() - done)

    def publish(self) -> int:
        """Publish the rows of every commit since the last published one; returns how many were produced."""
        import arro3.core as ac
        from deltalake import DeltaTable

        from kappa.log.generator import make_producer, produce
        from kappa.runtime.deltars import rs_uri

        with self._lock:
            uri = rs_uri(self.paths.table)
            if self._table is None:
                if not DeltaTable.is_deltatable(uri):
                    return 0
                self._table = DeltaTable(uri)
            else:  # the commits since the last look only, not the whole log again
                try:
                    self._table.update_incremental()
                except Exception:
                    self._table = None  # opened again at the next look
                    raise
            table = self._table
            latest = table.version()
            done = self.published_through()
            if latest <= done:
                return 0
            if done < 0:  # first publish: everything the table holds now
                data, changes = table.scan().read_all(), False
            else:
                # the job's tables have the change data feed on from their first commit (kappa.runtime.job)
                data = ac.Table.from_arrow(table.load_cdf(starting_version=done + 1, ending_version=latest))
                changes = True
            records = self._records(data, changes=changes)
            if records:
                if self._producer is None:
                    self._producer = make_producer(self.settings, {"client.id": "kappa-publish"})
                result = produce(self.settings, self.topic, records, producer=self._producer)
                if result.failed:
                    raise RuntimeError(f"{self.view.ref}: {result.failed} record(s) to {self.topic} failed: "
                                       f"{dict(result.errors)}")
            self.files.write(f"{self.paths.checkpoint}/{PROGRESS_FILE}",
                             json.dumps({"topic": self.topic, "delta_version": latest, "records": len(records)}))
            if self.metrics is not None:
                m = self.metrics
                m.g(m.published_rows).inc(len(records))
                m.g(m.published_version).set(latest)
            if records:
                log.info("%s: published %d row(s) of Delta versions %d..%d to %s", self.view.ref, len(records),
                         done + 1, latest, self.topic)
            return len(records)

    def _records(self, data: Any, *, changes: bool) -> list[tuple[bytes, bytes]]:
        """(key, value) of the rows to publish, in ``order_by`` order (DuckDB over the Arrow rows)."""
        import duckdb

        where = [f"({self.spec.where})"] if self.spec.where else []
        if changes:
            where.append("_change_type IN ({})".format(", ".join(f"'{c}'" for c in _NEW_IMAGES)))
        con = duckdb.connect(config={"enable_external_access": False})
        try:
            con.execute("SET TimeZone = 'UTC'")
            con.register("rows", data)
            empty = con.sql("SELECT * FROM rows LIMIT 0")
            types = dict(zip(empty.columns, empty.types))
            columns = [c for c in data.column_names if not c.startswith("_")]
            # timestamps leave as epoch milliseconds (the JSON the readers' schemas declare)
            select = ", ".join(f'epoch_ms("{c}") AS "{c}"' if str(types[c]).startswith("TIMESTAMP") else f'"{c}"'
                               for c in columns)
            sql = (f"SELECT {select} FROM rows" + (f" WHERE {' AND '.join(where)}" if where else "")
                   + " ORDER BY " + ", ".join(f'"{c}"' for c in (*self.spec.order_by, *self.spec.key)))
            rows = con.sql(sql).fetchall()
        finally:
            con.close()
        out = []
        for values in rows:
            row = dict(zip(columns, values))
            key = "|".join(str(row[k]) for k in self.spec.key)
            out.append((key.encode(), json.dumps(row, separators=(",", ":"), sort_keys=True).encode()))
        return out

    # ---------------------------------------------------------------------------------------------------
    def ensure_topic(self) -> None:
        """Converge the declared topic (created with its ``platform.yaml`` configs when missing). A cluster that
        refuses (no Create/AlterConfigs right: the chart's topics Job has them) is logged, not fatal - the
        produce then says whether the topic is there."""
        import dataclasses

        from kappa.catalog import load_catalog
        from kappa.log.topics import ensure_topics

        spec = load_catalog().topic(self.spec.topic)
        try:
            ensure_topics(self.settings, [dataclasses.replace(spec, name=self.topic)])
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("%s: cannot converge its publish topic %s: %s", self.view.ref, self.topic, one_line(exc))

    def start(self, interval: float) -> None:
        """Publish every ``interval`` seconds in a background thread until :meth:`stop`."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(interval,), name=f"publish-{self.view.ref}",
                                        daemon=True)
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.publish()
            except Exception as exc:  # noqa: BLE001 - retried next tick; the table stays the truth
                log.warning("%s: publishing to %s failed (retried): %s", self.view.ref, self.topic, one_line(exc))

    def stop(self, *, final: bool = True) -> None:
        """Stop the thread; ``final``: publish what the last commits added (a bounded run's end, a stop)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        if final:
            try:
                self.publish()
            except Exception as exc:  # noqa: BLE001 - the next start publishes it
                log.warning("%s: final publish to %s failed (the next start publishes it): %s", self.view.ref,
                            self.topic, one_line(exc))
