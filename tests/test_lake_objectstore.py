"""The lake on an S3-API object store (the project's SeaweedFS, ``object_store`` fixture), through the platform's own
code paths: the views' real jobs write their tables, checkpoints and the quarantine as objects; the registry,
retention leases and serving alias go through delta-rs's conditional puts; small lake files through obstore;
``kappa query`` reads it in a subprocess with nothing but the standard AWS environment.

Correctness is checked as on a local lake: every view's table equals its plain-Python oracle over the raw Kafka
records (tests/views_oracle.py), and nothing of the lake lands on the local disk.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from datetime import timedelta

import pytest

from kappa.config import Settings
from kappa.identity import ViewPaths
from kappa.log import generator
from kappa.log.broker import free_port
from tests.helpers import delta_log, run_to_end
from tests.test_metrics import scrape
from tests.test_metrics import value as metric_value
from tests.views_oracle import assert_views_match

pytestmark = pytest.mark.integration

VIEWS = ("events_raw", "campaign_catalog", "campaign_window_counts", "user_sessions")


@pytest.fixture
def s3_lake(kafka, declared_topics, object_store, spark, monkeypatch, request, tmp_path) -> Settings:
    """Settings with a fresh lake under ``s3a://kappa/<test>-<random>`` and this test's own topics; this process's
    delta-rs/obstore (environment) and Spark session (its Hadoop configuration: the JVM's environment is fixed at
    its start) reach the store."""
    from kappa.log.topics import declared_topics as declared, ensure_topics

    slug = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:30].lower()
    settings = kafka.settings.replace(home=tmp_path / "home", lake_uri=f"s3a://kappa/{slug}-{uuid.uuid4().hex[:6]}",
                                      topic_prefix=f"{slug}-{uuid.uuid4().hex[:6]}.")
    ensure_topics(settings, declared(settings))
    for key, value in object_store.delta_rs_options().items():
        monkeypatch.setenv(key, value)
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in object_store.spark_conf().items():
        hadoop.set(key.removeprefix("spark.hadoop."), value)
    return settings


def test_views_on_the_object_store_equal_the_oracle_and_run_again_as_a_no_op(spark, s3_lake, object_store, tmp_path):
    """The four views' real jobs on the store: tables equal their oracles, quarantine and checkpoint are objects,
    a second run is a no-op, and ``kappa query`` answers from a subprocess."""
    from deltalake import DeltaTable

    from kappa.control.registry import Registry
    from kappa.control.serving import ServingAlias
    from tests.conftest import subprocess_env
    from tests.docs_blocks import ROOT

    from kappa.runtime.checkpoint import last_commit, list_names, read_text
    from kappa.runtime.deltars import read_rows

    u = generator.universe(seed=21, campaigns=10, users=200)
    generator.publish_campaigns(s3_lake, generator.campaign_records(u), topic=s3_lake.topic("campaigns"))
    stream = generator.events(2000, seed=21, universe=u, start_ms=1_700_000_000_000, rate_per_s=25,
                              late_fraction=0.1, max_lateness_ms=5000, malformed_fraction=0.2)
    assert generator.produce(s3_lake, s3_lake.topic("ad-events"), stream).delivered == 2000

    for name in VIEWS:
        run_to_end(spark, s3_lake, f"jobs.{name}.v1")
    stats = assert_views_match(spark, s3_lake)
    assert stats["valid"] + stats["quarantined"] == stats["consumed"] == 2000
    assert stats["quarantined"] >= 0.15 * 2000 and stats["final_windows"] > 0

    paths = ViewPaths(s3_lake.lake_uri, "events_raw", 1)
    # the quarantine is a delta-rs table, created by delta-rs too: raw bytes, topic, partition, offset and reason
    quarantine = DeltaTable(paths.quarantine)
    mine = [r for r in read_rows(quarantine) if r["view"] == "events_raw"]
    assert len(mine) == stats["quarantined"]
    assert all(r["raw_value"] is not None and r["topic"] == s3_lake.topic("ad-events") and r["error"] for r in mine)
    assert len({(r["partition"], r["offset"]) for r in mine}) == len(mine), "a bad record quarantined twice"
    created = quarantine.history()[-1]
    assert created["operation"] == "CREATE TABLE" and "delta-rs" in created.get("clientVersion", ""), created

    # the checkpoint is objects in the store, read without Spark (obstore): offsets of every partition
    run = json.loads(read_text(f"{paths.checkpoint}/run.json") or "{}")
    assert run.get("run_id"), run
    committed, _ = last_commit(f"{paths.checkpoint}/main", s3_lake.topic("ad-events"))
    assert sum(committed.values()) == 2000
    assert {"main", "run.json"} <= set(list_names(paths.checkpoint))
    # nothing of the lake on the local disk
    assert not (tmp_path / "home" / "lake").exists()

    # running again over the same log: the checkpoint (offsets, commits and the RocksDB state of the window
    # view) on the store is complete, nothing is duplicated
    run_to_end(spark, s3_lake, "jobs.campaign_window_counts.v1")
    assert assert_views_match(spark, s3_lake) == stats

    # an analyst's shell: only KAPPA_LAKE_URI and the standard AWS variables; DuckDB over delta-rs answers
    reg = Registry(s3_lake.lake_uri)
    _serve(reg, ServingAlias(s3_lake.lake_uri, registry=reg), 1)
    proc = subprocess.run(["bin/kappa", "query", "SELECT count(*) + 424242000 AS n FROM events_raw"], cwd=ROOT,
                          env=subprocess_env(s3_lake, **object_store.delta_rs_options()), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(424242000 + stats["valid"]) in proc.stdout.replace(",", ""), proc.stdout


def test_registry_alias_and_retire_on_the_object_store(s3_lake):
    """Registry, audit events, serving alias and the deletion of an expired retired version: delta-rs commits
    and obstore deletes on the store, refusing anything outside the lake."""
    from kappa.control.registry import Registry
    from kappa.control.serving import ServingAlias
    from kappa.control.registry import utcnow
    from kappa.runtime.checkpoint import read_text, tree_exists, write_text

    reg = Registry(s3_lake.lake_uri)
    alias = ServingAlias(s3_lake.lake_uri, registry=reg)
    for version in (1, 2):
        _serve(reg, alias, version)
        write_text(f"{ViewPaths(s3_lake.lake_uri, 'events_raw', version).checkpoint}/run.json", "{}")
    assert alias.alias("events_raw").version == 2
    assert reg.get("events_raw", 1).state == "retired"
    v1_root = ViewPaths(s3_lake.lake_uri, "events_raw", 1).root
    reg.set_state("events_raw", 1, "retired", by="test", delete_after=utcnow() - timedelta(minutes=1))
    assert tree_exists(v1_root)
    results = alias.delete_expired(by="test")
    assert [(r.version, r.deleted) for r in results] == [(1, True)], [r.message for r in results]
    assert not tree_exists(v1_root) and tree_exists(ViewPaths(s3_lake.lake_uri, "events_raw", 2).root)
    assert reg.get("events_raw", 1).deleted_at is not None
    assert ("serving", 2) in {(e.to_state, e.version) for e in reg.events("events_raw")}
    # the analysts' Spark views over the aliases: one PUT of catalog.sql, read back from the store
    from kappa.control.replay.switch import catalog_sql_path, write_catalog_sql

    assert write_catalog_sql(s3_lake) == catalog_sql_path(s3_lake)
    sql = read_text(catalog_sql_path(s3_lake)) or ""
    assert "analytics.events_raw" in sql and ViewPaths(s3_lake.lake_uri, "events_raw", 2).table in sql, sql


def _serve(reg, alias, version: int) -> None:
    from kappa.runtime.deltars import I64, create_table

    paths = ViewPaths(reg.lake_uri, "events_raw", version)
    create_table(paths.table, (("n", I64),))  # the version's table (a real job writes it in the test above)
    reg.register("events_raw", version, code_module=f"jobs.events_raw.v{version}", table_path=paths.table,
                 app_id=f"kappa:events_raw@v{version}:r1", starting="earliest", triggered_by="test")
    for state in ("caught_up", "verified"):
        reg.set_state("events_raw", version, state, by="test")
    alias.promote("events_raw", version, by="test")


def _registry_updates(lake: str, worker: int, rounds: int) -> None:
    """One process's share of the race: ``rounds`` field updates of one registry row (compare-and-set)."""
    from kappa.control.registry import Registry

    reg = Registry(lake)
    for n in range(rounds):
        reg.set_state("events_raw", 1, "building", by=f"p{worker}", note=f"p{worker}-{n}")


def _quarantine_appends(lake: str, worker: int, rounds: int) -> None:
    """One process's share: ``rounds`` idempotent quarantine appends of its own view version (as a driver does),
    each batch appended twice (a batch re-run after a crash)."""
    from deltalake import DeltaTable

    from kappa.identity import ViewPaths
    from kappa.runtime.deltars import append_once, arrow_rows, create_table, rs_uri
    from kappa.runtime.sink import QUARANTINE_COLUMNS

    path = rs_uri(ViewPaths(lake, "events_raw", 1).quarantine)
    create_table(path, QUARANTINE_COLUMNS, partition_by=("view",))  # every driver creates it at its start
    table = DeltaTable(path)
    for batch in range(rounds):
        rows = [{"view": f"w{worker}", "version": 1, "topic": "t", "partition": worker, "offset": batch * 10 + i,
                 "raw_value": b"x", "error": "bad", "batch_id": batch} for i in range(3)]
        for _ in range(2):
            append_once(table, arrow_rows(QUARANTINE_COLUMNS, rows), f"kappa:w{worker}@v1:r1/quarantine", batch)


def _table_creations(lake: str, worker: int, rounds: int, barrier) -> None:
    """One process's share: in each round, at the same instant as the others (a barrier), create the round's
    table as every driver creates the shared quarantine at its start."""
    from kappa.runtime.deltars import create_table, rs_uri
    from kappa.runtime.sink import QUARANTINE_COLUMNS

    for n in range(rounds):
        barrier.wait(120)
        create_table(rs_uri(f"{lake}/race/quarantine-{n}"), QUARANTINE_COLUMNS, partition_by=("view",))


def _race_processes(target, lake: str, workers: int, rounds: int, *, barrier: bool = False) -> None:
    """Start ``workers`` processes (spawned: a fresh interpreter each, as separate drivers and CLI/Airflow
    processes are), each running ``target(lake, worker, rounds[, barrier])``; every one must succeed."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    extra = (ctx.Barrier(workers),) if barrier else ()
    procs = [ctx.Process(target=target, args=(lake, w, rounds, *extra)) for w in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
    assert [proc.exitcode for proc in procs] == [0] * workers


def test_many_processes_commit_to_one_table_on_the_store_and_lose_nothing(s3_lake, object_store):
    """The multi-writer tables of the lake, through the platform's own code paths, from 4 processes at once on the
    store: registry updates of ONE row (compare-and-set over delta-rs's conditional put) and quarantine appends to
    one table that every process also creates at its start. Afterwards every commit is there exactly once."""
    from deltalake import DeltaTable

    from kappa.control.registry import Registry
    from kappa.runtime.deltars import read_rows, rs_uri

    reg = Registry(s3_lake.lake_uri)
    paths = ViewPaths(s3_lake.lake_uri, "events_raw", 1)
    reg.register("events_raw", 1, code_module="jobs.events_raw.v1", table_path=paths.table,
                 app_id="kappa:events_raw@v1:r1", starting="earliest", triggered_by="test")
    workers, rounds = 4, 5
    _race_processes(_registry_updates, s3_lake.lake_uri, workers, rounds)
    row = reg.get("events_raw", 1)
    assert row.revision == 1 + workers * rounds, "a registry update was lost"
    notes = [e.note for e in reg.events("events_raw", 1)]
    assert sorted(n for n in notes if n and n.startswith("p")) == sorted(f"p{w}-{n}" for w in range(workers)
                                                                      for n in range(rounds))

    _race_processes(_quarantine_appends, s3_lake.lake_uri, workers, rounds)
    table = DeltaTable(rs_uri(paths.quarantine))
    rows = read_rows(table)
    assert len(rows) == workers * rounds * 3, "a quarantine append was lost or applied twice"
    assert len({(r["view"], r["offset"]) for r in rows}) == len(rows)
    creates = [h for h in table.history() if h["operation"] == "CREATE TABLE"]
    assert len(creates) == 1, creates  # one creator won; the others used its table

    # the creation itself, 4 processes released at the same instant, round after round: one CREATE TABLE each
    _race_processes(_table_creations, s3_lake.lake_uri, workers, rounds, barrier=True)
    for n in range(rounds):
        history = DeltaTable(rs_uri(f"{s3_lake.lake_uri}/race/quarantine-{n}")).history()
        assert [h["operation"] for h in history] == ["CREATE TABLE"], history


# ---------------------------------------------------------------------------------------------------------------
# A repair beside the live job: on the store the swap is committed by the live job's own JVM (kappa.runtime.repairs)

REPAIRED = "campaign_window_counts"
T0 = 1_700_300_000_000  # a whole 10 s


def _driver(s3_lake, object_store, log_path, metrics_port: int | None = None) -> subprocess.Popen:
    """The serving version's live driver, a JVM of its own (as the local runner and the chart start it)."""
    import sys

    from tests.conftest import subprocess_env
    from tests.docs_blocks import ROOT

    env = subprocess_env(s3_lake, **object_store.delta_rs_options())
    return subprocess.Popen([sys.executable, "-m", "kappa.runtime.driver", "view", REPAIRED, "--version", "1",
                             "--starting", "earliest", "--trigger-seconds", "1",
                             *(["--metrics-port", str(metrics_port)] if metrics_port else [])], cwd=ROOT, env=env,
                            stdout=open(log_path, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _caught_up(settings, checkpoint: str, topic: str, proc, log_path, timeout: float = 300.0) -> None:
    import time

    from kappa.log.topics import partition_offsets
    from kappa.runtime.checkpoint import last_commit

    ends = {p: hi for p, (_lo, hi) in partition_offsets(settings, topic).items()}
    deadline = time.monotonic() + timeout
    while last_commit(checkpoint, topic)[0] != ends:
        assert proc.poll() is None, f"the live driver exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the live driver did not reach {ends}:\n{log_path.read_text()[-3000:]}"
        time.sleep(1)


def _final(spark, table: str, ranges, proc, log_path, timeout: float = 120.0) -> None:
    """Wait until the table has rows in every range and none of them open (``is_final``)."""
    import time

    from pyspark.sql import functions as F

    deadline = time.monotonic() + timeout
    while True:
        rows = spark.read.format("delta").load(table)
        counts = [rows.where((F.col("window_start") >= F.timestamp_millis(F.lit(a)))
                             & (F.col("window_start") < F.timestamp_millis(F.lit(b))))
                  .agg(F.count(F.lit(1)), F.sum((~F.col("is_final")).cast("int"))).collect()[0] for a, b in ranges]
        if all(n and not open_ for n, open_ in counts):
            return
        assert proc.poll() is None, f"the live driver exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the ranges did not become final: {counts}"
        time.sleep(1)


@pytest.mark.timeout(1500)
def test_a_repair_is_committed_by_the_live_job_between_its_own_commits(spark, s3_lake, object_store, tmp_path):
    """A repair while the live job (its own JVM) commits a micro-batch every second, then one while it is
    stopped: the repairing process never commits to the serving table; the live job commits each swap in its JVM
    between its own commits, once; no batch commit is lost (every committed micro-batch's Delta transaction is in
    the table's log); the repaired windows equal a plain-Python count over the raw log. The driver's
    ``kappa_last_delta_version`` is the table's newest version on the store (its JSON commits, read as objects)."""
    import threading
    import time
    from collections import Counter

    from kappa.control.replay.repair import repair_range
    from kappa.runtime.checkpoint import batch_ids, read_text
    from kappa.runtime.repairs import request_uri, result_uri
    from kappa.verify import oracle

    u = generator.universe(seed=61, campaigns=4, users=60)
    generator.publish_campaigns(s3_lake, generator.campaign_records(u), topic=s3_lake.topic("campaigns"))
    topic = s3_lake.topic("ad-events")
    generator.produce(s3_lake, topic, generator.events(1500, seed=61, universe=u, start_ms=T0, rate_per_s=10))
    paths = ViewPaths(s3_lake.lake_uri, REPAIRED, 1)
    log_path = tmp_path / "driver.log"
    ranges = [(T0 + 30_000, T0 + 60_000), (T0 + 60_000, T0 + 90_000)]
    port = free_port()
    driver = _driver(s3_lake, object_store, log_path, metrics_port=port)
    stop = threading.Event()
    try:
        _caught_up(s3_lake, f"{paths.checkpoint}/main", topic, driver, log_path)
        # corrected records of the two ranges, long after the watermark passed them: the live job drops them
        for n, (start, _end) in enumerate(ranges):
            generator.produce(s3_lake, topic, generator.events(60, seed=70 + n, universe=u, start_ms=start,
                                                               rate_per_s=2))

        def traffic() -> None:  # on-time events after the ranges: the live job commits batch after batch
            n = 0
            while not stop.is_set():
                generator.produce(s3_lake, topic, generator.events(20, seed=100 + n, universe=u,
                                                                   start_ms=T0 + 150_000 + n * 2000, rate_per_s=10))
                n += 1
                stop.wait(0.5)

        producer = threading.Thread(target=traffic, daemon=True)
        producer.start()
        # a repair of an open range is refused: the ranges are final once the live job committed a batch after
        # the one whose watermark passed them (the traffic moves it past the last range)
        _final(spark, paths.table, ranges, driver, log_path)
        results = []
        for start, end in ranges[:1]:
            results.append(repair_range(REPAIRED, s3_lake, start_ms=start, end_ms=end, by="test", spark=spark,
                                        wait_seconds=300))
        assert all(r.swapped and r.verified and not r.waiting for r in results), [r.message for r in results]
        assert all("committed by campaign_window_counts@v1's live job" in r.message for r in results), results
        stop.set()
        producer.join(60)
        _caught_up(s3_lake, f"{paths.checkpoint}/main", topic, driver, log_path)
        deadline = time.monotonic() + 60  # the gauge follows the table at the driver's next metrics poll
        while (reported := metric_value(scrape(port), "kappa_last_delta_version", view=REPAIRED)) != max(
                newest := delta_log(paths.table)):
            assert time.monotonic() < deadline, f"kappa_last_delta_version {reported}, the table's {max(newest)}"
            time.sleep(2)
    finally:
        stop.set()
        _stop(driver)

    # the job is stopped: the second repair is verified and handed over, and waits for the job's next start
    before = max(delta_log(paths.table))
    waiting = repair_range(REPAIRED, s3_lake, start_ms=ranges[1][0], end_ms=ranges[1][1], by="test", spark=spark,
                           wait_seconds=3)
    assert waiting.waiting and not waiting.swapped and waiting.verified, waiting.message
    assert "it commits the swap when it next runs" in waiting.message, waiting.message
    repair_id = waiting.staging.rsplit("/", 1)[-1]
    assert read_text(request_uri(paths.root, repair_id)) is not None
    assert max(delta_log(paths.table)) == before, "nothing was committed while the job was stopped"
    driver = _driver(s3_lake, object_store, log_path)
    try:
        deadline = time.monotonic() + 300
        while read_text(result_uri(paths.root, repair_id)) is None:
            assert driver.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the restarted job did not apply the waiting repair"
            time.sleep(1)
        answer = json.loads(read_text(result_uri(paths.root, repair_id)))
        # the job writes its answer, then removes the request (a crash between the two applies it again: a no-op)
        while read_text(request_uri(paths.root, repair_id)) is not None:
            assert time.monotonic() < deadline, "an answered request is removed"
            time.sleep(0.5)
    finally:
        _stop(driver)
    assert driver.returncode == 0, log_path.read_text()[-3000:]

    # ---- the table's log, read as plain objects: who committed what
    commits = delta_log(paths.table)
    assert sorted(commits) == list(range(max(commits) + 1)), "a Delta version is missing"
    txns: dict[str, list[int]] = {}
    repairs: dict[str, list[int]] = {}
    for version, actions in commits.items():
        for action in actions:
            if "txn" in action:
                txns.setdefault(action["txn"]["appId"], []).append(action["txn"]["version"])
            if "commitInfo" in action and action["commitInfo"].get("userMetadata"):
                meta = json.loads(action["commitInfo"]["userMetadata"])
                if "repair" in meta.get("kappa", {}):
                    repairs.setdefault(meta["kappa"]["repair"]["id"], []).append(version)
    job_apps = [app for app in txns if not app.startswith("kappa-repair-")]
    assert len(job_apps) == 1, txns  # the live job's, across its two runs; nobody else wrote micro-batches
    job_app = job_apps[0]
    ids = [r.staging.rsplit("/", 1)[-1] for r in [*results, waiting]]
    # every repair committed exactly once, by the live job, in the Delta version it answered
    assert {i: len(repairs.get(i, [])) for i in ids} == dict.fromkeys(ids, 1), repairs
    assert sorted(txns) == sorted([job_app, *(f"kappa-repair-{i}" for i in ids)]), txns
    assert [repairs[i][0] for i in ids] == [r.delta_version for r in results] + [answer["delta_version"]]
    for i in ids:
        meta = json.loads(next(a["commitInfo"]["userMetadata"] for a in commits[repairs[i][0]] if "commitInfo" in a))
        assert meta["kappa"]["repair"]["applied_by"] == job_app, meta
    # no micro-batch commit lost: every batch the checkpoint committed since the first is in the table's log once
    batches = sorted(txns[job_app])
    committed = [b for b in batch_ids(f"{paths.checkpoint}/main/commits") if b >= batches[0]]
    assert batches == committed, (batches[-5:], committed[-5:])

    # ---- the repaired ranges hold every valid view event of a mapped ad, the corrections included, counted from
    # the raw log in plain Python
    from deltalake import DeltaTable

    from kappa.control.replay import table_rows

    rows = table_rows(DeltaTable(paths.table.replace("s3a://", "s3://")))[1]
    table = {(r["campaign_id"], oracle.epoch_ms(r["window_start"])): (r["view_count"], r["is_final"]) for r in rows}
    mapping = dict(generator.campaign_records(u))
    counts: Counter = Counter()
    for rec in oracle.read_log(s3_lake, topic):
        event = json.loads(rec.value)
        window = event["event_time"] - event["event_time"] % 10_000
        if event["event_type"] == "view" and any(start <= window < end for start, end in ranges):
            counts[(mapping[event["ad_id"]], window)] += 1
    repaired = {k: n for k, (n, _final) in table.items() if any(start <= k[1] < end for start, end in ranges)}
    assert repaired == dict(counts)
    assert all(final for k, (_n, final) in table.items() if k in repaired)


# ---------------------------------------------------------------------------------------------------------------
# The control: what the hand-off avoids. Two Spark drivers committing to ONE table on the store through
# delta-spark's default S3 log store (it excludes concurrent commits inside one JVM only) lose commits silently.


def _spark_appends(lake: str, worker: int, rounds: int, barrier, lost) -> None:
    """One Spark driver (its own JVM): one single-row append per round to ``<lake>/control``, every round released
    at the same instant as the other driver's (Delta retries the appends it sees conflict; none fails), until a
    round ends with fewer rows in the table than appends made (worker 0 counts; both stop together)."""
    from kappa.config import Settings
    from kappa.runtime.spark import build_spark, stop_spark

    spark = build_spark(f"control-{worker}", Settings.from_env().replace(lake_uri=lake), driver_memory="512m")
    try:
        barrier.wait(300)  # both JVMs are up
        for n in range(rounds):
            barrier.wait(120)
            spark.createDataFrame([(worker, n)], "writer INT, round INT").write.format("delta").mode("append").save(
                f"{lake}/control")
            barrier.wait(120)
            if worker == 0 and spark.read.format("delta").load(f"{lake}/control").count() < 2 * (n + 1):
                lost.set()
            barrier.wait(120)
            if lost.is_set():
                return
    finally:
        stop_spark(spark)


@pytest.mark.slow  # a control: it runs a configuration the platform never uses (make test-long)
@pytest.mark.timeout(900)
def test_control_two_spark_drivers_on_the_default_s3_log_store_lose_commits(spark, s3_lake):
    """The unsafe configuration the platform never uses, run on purpose: two drivers append at the same instants,
    every append reports success, yet the table lacks one - a commit object overwritten by the other driver's
    (a few percent of the rounds here, so the drivers go on until the first loss, up to 300 rounds). The checks
    of the repair test above (every committed transaction in the table's log, once) are what catches this."""
    import multiprocessing

    spark.createDataFrame([], "writer INT, round INT").write.format("delta").save(f"{s3_lake.lake_uri}/control")
    ctx = multiprocessing.get_context("spawn")
    barrier, lost = ctx.Barrier(2), ctx.Event()
    procs = [ctx.Process(target=_spark_appends, args=(s3_lake.lake_uri, w, 300, barrier, lost)) for w in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(800)
    assert [proc.exitcode for proc in procs] == [0, 0]
    rows = {(r["writer"], r["round"]) for r in spark.read.format("delta").load(f"{s3_lake.lake_uri}/control").collect()}
    rounds = 1 + max(n for _w, n in rows)
    commits = delta_log(f"{s3_lake.lake_uri}/control")
    print(f"control: 2 drivers x {rounds} appends, {len(rows)} rows in the table, {2 * rounds - len(rows)} "
          f"appends lost; Delta versions 0..{max(commits)}")
    assert lost.is_set() and len(rows) < 2 * rounds, "no commit was lost: the control did not exercise the race"
    assert len(commits) == max(commits) + 1  # no gap: a lost commit leaves no trace but the missing rows


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_with_the_lake_on_the_store_loses_and_duplicates_nothing(spark, s3_lake, tmp_path):
    """The exactly-once proof of tests/test_exactly_once.py with every table and checkpoint on the store: the four
    views' drivers SIGKILLed at named phases of a batch (nothing written; view table committed, quarantine not;
    both committed, checkpoint not) and at random moments, restarted, then every view equal to its oracle.

    A fault loop (``make test-long``). Seed 24 kills the window view's first driver during batch 0: its restart
    compacts batch 0 alone, runs it again, and Spark still updates a window of it in batch 1 (what the finality of
    kappa/runtime/sink.py and tests/test_finality.py are about). On failure it prints every table's commits and
    checkpoint."""
    from tests.helpers import committed_batches
    from tests.test_exactly_once import _prove

    try:
        _prove(spark, s3_lake, tmp_path, kills=4, seed=24, events=3000, drain_here=True)
    except AssertionError:  # what each table's log and checkpoint hold, to tell which commit is extra
        for view in ("campaign_window_counts", "user_sessions", "events_raw", "campaign_catalog"):
            paths = ViewPaths(s3_lake.lake_uri, view, 1)
            for name, table in (("table", paths.table), ("staging", paths.staging)):
                for version, actions in sorted(delta_log(table).items()):
                    info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
                    print(view, name, version, info.get("operation"), info.get("operationMetrics"),
                          [(a["txn"]["appId"][-14:], a["txn"]["version"]) for a in actions if "txn" in a],
                          sum(1 for a in actions if "add" in a), "adds", (info.get("userMetadata") or "")[:160])
            print(view, "checkpoint commits", committed_batches(f"{paths.checkpoint}/main"))
        raise


def test_a_wrong_endpoint_bucket_or_credential_is_one_line_and_creates_nothing(s3_lake, object_store, monkeypatch,
                                                                              tmp_path):
    """A lake the store refuses: a view driver, ``kappa up`` and ``kappa lake check`` (the chart's pre-install check)
    stop before Spark or anything else starts, with one line naming what is wrong (the bucket, the access key, the
    secret, the endpoint, a plain-HTTP endpoint not allowed); nothing lands in the lake."""
    import sys

    from kappa.runtime.checkpoint import LakeError, check_lake, tree_exists
    from tests.conftest import subprocess_env
    from tests.docs_blocks import ROOT

    good = object_store.delta_rs_options()
    access = good["AWS_ACCESS_KEY_ID"]
    cases = {  # what is wrong -> (lake, environment, the line's words)
        "bucket": (f"s3a://no-such-bucket/{uuid.uuid4().hex[:6]}", {},
                   "bucket no-such-bucket does not exist at"),
        "access key": (s3_lake.lake_uri, {"AWS_ACCESS_KEY_ID": "NOBODY"},
                       "does not know the access key NOBODY (AWS_ACCESS_KEY_ID)"),
        "secret": (s3_lake.lake_uri, {"AWS_SECRET_ACCESS_KEY": "wrong"},
                   f"refused the secret key given for {access} (AWS_SECRET_ACCESS_KEY)"),
        "endpoint": (s3_lake.lake_uri, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
                     "object store at http://127.0.0.1:9 is not reachable (AWS_ENDPOINT_URL)"),
        "plain http": (s3_lake.lake_uri, {"AWS_ALLOW_HTTP": "false"},
                       "is plain HTTP, which delta-rs and obstore refuse unless AWS_ALLOW_HTTP=true"),
    }
    check_lake(s3_lake.lake_uri)  # the right configuration passes
    for what, (lake, env, words) in cases.items():
        with monkeypatch.context() as patched, pytest.raises(LakeError) as refused:
            for key, value in env.items():
                patched.setenv(key, value)
            check_lake(lake)
        assert words in str(refused.value) and "\n" not in str(refused.value), (what, str(refused.value))
    for what in ("secret", "bucket"):
        lake, env, words = cases[what]
        settings = s3_lake.replace(lake_uri=lake)
        driver = subprocess.run([sys.executable, "-m", "kappa.runtime.driver", "view", "events_raw"], cwd=ROOT,
                                env=subprocess_env(settings, **{**good, **env}), capture_output=True, text=True,
                                timeout=120)
        up = subprocess.run(["bin/kappa", "up"], cwd=ROOT, env=subprocess_env(settings, **{**good, **env}),
                            capture_output=True, text=True, timeout=120)
        check = subprocess.run(["bin/kappa", "lake", "check"], cwd=ROOT,
                               env=subprocess_env(settings, **{**good, **env}), capture_output=True, text=True,
                               timeout=120)
        for proc in (driver, up, check):
            assert proc.returncode == 2, (what, proc.stdout, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), (what, proc.stderr)
            assert words in proc.stderr and "Traceback" not in proc.stderr and "Exception" not in proc.stderr
    # no credential at all (the SDK's chain falls through to the instance metadata service, refused here)
    with monkeypatch.context() as patched, pytest.raises(LakeError) as refused:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            patched.delenv(key, raising=False)
        check_lake("s3a://kappa/no-credential")
    assert "no credential for the lake's object store at AWS S3: set AWS_ACCESS_KEY_ID" in str(refused.value)
    # a home whose own store is down, no other named: the command says to start it
    (tmp_path / "home" / "objectstore").mkdir(parents=True)
    bare = {k: v for k, v in subprocess_env(s3_lake.replace(home=tmp_path / "home")).items()
            if k not in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    down = subprocess.run(["bin/kappa", "lake", "check"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=bare)
    assert down.returncode == 2 and "platform's own object store" in down.stderr and "not running" in down.stderr, \
        down.stderr
    ok = subprocess.run(["bin/kappa", "lake", "check"], cwd=ROOT, env=subprocess_env(s3_lake, **good),
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and f"the store at {good['AWS_ENDPOINT_URL']} lists it" in ok.stdout, ok.stdout + ok.stderr
    assert not tree_exists(s3_lake.lake_uri), "nothing of the lake was created"


def _at_end(settings: Settings, view: str) -> bool:
    """Has ``view``'s driver committed a micro-batch that ends at the end of its stream topic?"""
    from kappa.catalog import load_catalog
    from kappa.log.topics import partition_offsets
    from kappa.runtime.checkpoint import last_commit
    from kappa.runtime.view import load_view

    topic = settings.topic(load_view(load_catalog().module_of(view, 1)).stream_topic)
    ends = {p: hi for p, (_lo, hi) in partition_offsets(settings, topic).items()}
    return last_commit(f"{ViewPaths(settings.lake_uri, view, 1).checkpoint}/main", topic)[0] == ends


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_second_driver_of_a_version_on_another_machine_is_refused_and_a_crashed_one_is_taken_over(
        spark, s3_lake, tmp_path):
    """Two machines' drivers of one view version on a lake on the store (each its own home, so their local locks
    do not see each other: only the lease on the lake does). The second is refused, naming the first, which keeps
    committing; the first SIGKILLed, a driver of this machine takes the lease over at once and finishes the log:
    every record in the table once. (``make test-long``: three driver JVMs, 2-4 minutes; the lease itself is
    tested in ``make test`` by tests/test_driver_lease.py.)"""
    import os
    import signal
    import time

    from deltalake import DeltaTable

    from kappa.log.topics import partition_offsets
    from kappa.runtime.checkpoint import last_commit
    from kappa.runtime.deltars import rs_uri
    from tests.crashloop import _start
    from tests.helpers import committed_batches

    topic = s3_lake.topic("ad-events")
    sent = 0

    def produce(n: int, seed: int) -> None:
        nonlocal sent
        stream = generator.events(n, seed=seed, start_ms=1_700_200_000_000 + seed * 60_000, rate_per_s=50)
        assert generator.produce(s3_lake, topic, stream).delivered == n
        sent += n

    produce(600, 1)
    paths = ViewPaths(s3_lake.lake_uri, "events_raw", 1)
    checkpoint = f"{paths.checkpoint}/main"
    env = {"KAPPA_DRIVER_LEASE_SECONDS": "6", "KAPPA_CRASH_BATCH": "100"}
    first = _start(s3_lake, "events_raw", tmp_path / "first.log", **env)
    procs = [first]
    try:
        deadline = time.monotonic() + 300
        while len(committed_batches(checkpoint)) < 2:
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.5)
        second = _start(s3_lake.replace(home=tmp_path / "machine-b"), "events_raw", tmp_path / "second.log", **env)
        procs.append(second)
        assert second.wait(timeout=300) != 0
        said = (tmp_path / "second.log").read_text()
        assert f"events_raw@v1 is already running (pid {first.pid} on " in said, said[-3000:]
        assert "Traceback" not in said, said[-3000:]
        before = len(committed_batches(checkpoint))
        produce(300, 2)
        while len(committed_batches(checkpoint)) <= before:  # the first one kept committing
            assert first.poll() is None and time.monotonic() < deadline + 300, "the first driver stopped"
            time.sleep(0.5)

        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
        produce(300, 3)
        third = _start(s3_lake.replace(home=tmp_path / "machine-b"), "events_raw", tmp_path / "third.log", **env)
        procs.append(third)
        ends = {p: hi for p, (_lo, hi) in partition_offsets(s3_lake, topic).items()}
        deadline = time.monotonic() + 400
        while last_commit(checkpoint, topic)[0] != ends:
            assert third.poll() is None and time.monotonic() < deadline, (tmp_path / "third.log").read_text()[-3000:]
            time.sleep(1)
        assert f"took over the driver lease of pid {first.pid} on " in (tmp_path / "third.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)
    rows = DeltaTable(rs_uri(paths.table)).scan().read_all()
    keys = list(zip(rows.column("partition").to_pylist(), rows.column("offset").to_pylist()))
    assert len(keys) == len(set(keys)) == sent


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_store_outage_mid_stream_is_waited_out(spark, s3_lake, object_store, tmp_path):
    """The store stopped and started again (down ~45 s: 30 s, its stop and its 17 s start) while the four views'
    drivers (each its own JVM, 0.5 s trigger) run, with traffic for every view arriving during the outage: every
    driver is still running when the store is back (its micro-batch waited inside S3A's retries), each catches up
    to the end of the log, and every view equals its oracle - nothing lost, nothing twice, every bad record
    quarantined once."""
    import os
    import random
    import signal
    import time

    from tests.crashloop import VIEWS, _catalog_churn, _start
    from tests.helpers import committed_batches

    u = generator.universe(seed=33, campaigns=10, users=200)
    generator.publish_campaigns(s3_lake, generator.campaign_records(u), topic=s3_lake.topic("campaigns"))
    t0 = 1_700_100_000_000

    def produce(seed: int, n: int, start_ms: int) -> None:
        stream = generator.events(n, seed=seed, universe=u, start_ms=start_ms, rate_per_s=40, late_fraction=0.05,
                                  max_lateness_ms=60_000, malformed_fraction=0.05)
        assert generator.produce(s3_lake, s3_lake.topic("ad-events"), stream).delivered == n

    produce(33, 1200, t0)
    procs = {view: _start(s3_lake, view, tmp_path / f"{view}.log") for view in VIEWS}
    try:
        deadline = time.monotonic() + 420
        checkpoints = {v: f"{ViewPaths(s3_lake.lake_uri, v, 1).checkpoint}/main" for v in VIEWS}
        while not all(_at_end(s3_lake, v) for v in VIEWS):
            assert time.monotonic() < deadline, "the views did not catch up before the outage"
            assert all(p.poll() is None for p in procs.values()), "a driver exited before the outage"
            time.sleep(1)
        before = {v: len(committed_batches(c)) for v, c in checkpoints.items()}
        assert object_store.stop() is True
        outage = time.monotonic()
        produce(34, 600, t0 + 30_000)  # traffic for every view while the lake is gone
        _catalog_churn(s3_lake, random.Random(34))
        time.sleep(max(0.0, 30 - (time.monotonic() - outage)))
        down = {v: p.poll() for v, p in procs.items()}
        object_store.start()
        print(f"store down {time.monotonic() - outage:.1f} s; back in {object_store.last_start_seconds:.1f} s")
        assert down == {v: None for v in VIEWS}, f"drivers that did not wait out the outage: {down}"
        produce(35, 600, t0 + 45_000)
        deadline = time.monotonic() + 600
        while not all(_at_end(s3_lake, v) for v in VIEWS):
            exited = {v: p.poll() for v, p in procs.items() if p.poll() is not None}
            assert not exited, f"drivers exited after the outage: {exited} (logs in {tmp_path})"
            assert time.monotonic() < deadline, "the views did not catch up after the outage"
            time.sleep(2)
        after = {v: len(committed_batches(c)) for v, c in checkpoints.items()}
        assert all(after[v] > before[v] for v in VIEWS), (before, after)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            proc.wait(timeout=120)
    stats = assert_views_match(spark, s3_lake)
    print(f"outage: every view equals its oracle after the store restart: {stats}")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_make_run_and_an_airflow_replay_promote_and_rollback_with_the_lake_on_the_store(kafka, object_store,
                                                                                       tmp_path, monkeypatch):
    """The local platform with its lake on an S3-API store, as an operator uses it: ``make run`` (view host,
    producer, Airflow standalone - every process given the store only through the standard AWS variables), the
    docs' Airflow replay of campaign_window_counts v2 with its cascade (replay, strict verification, promotion of
    both views), queries through the alias, the rollback, ``make down``. Nothing of the lake is on the local disk;
    the registry and the alias read back from the store say what the commands said."""
    import os

    from kappa.control.registry import Registry
    from kappa.control.serving import ServingAlias
    from tests.docs_blocks import ROOT
    from tests.helpers import Walk

    home = tmp_path / "home"
    lake = f"s3a://kappa/make-run-{uuid.uuid4().hex[:8]}"
    store_env = object_store.delta_rs_options()
    env = {**os.environ, **kafka.env, **store_env, "KAPPA_HOME": str(home), "KAPPA_LAKE_URI": lake,
           "KAPPA_TOPIC_PREFIX": f"store{uuid.uuid4().hex[:6]}-", "KAPPA_AIRFLOW_PORT": str(free_port()),
           "KAPPA_CLI": "bin/kappa"}
    env.pop("KAPPA_LOCAL_DRIVER", None)
    for key, value in store_env.items():  # this process reads the registry and alias back from the store
        monkeypatch.setenv(key, value)
    walk = Walk(env)
    view = "campaign_window_counts"
    try:
        out = walk.run("make run", where="make run", timeout=1500)
        assert re.search(r"ready in \d+ s: every view has committed rows", out), out
        out = walk.run("bin/kappa airflow trigger kappa_replay --conf '{\"view\": \"%s\", \"version\": 2, "
                       "\"auto_promote\": true, \"cascade\": true, \"watch_minutes\": 0.2}' --wait" % view,
                       where="airflow replay", timeout=1800)
        assert re.search(r"^success ", out, re.M), out
        status = walk.run("bin/kappa status", where="status")
        assert re.search(rf"{view}@v2\s+serving", status) and re.search(rf"{view}@v1\s+retired", status), status
        assert re.search(r"campaign_hourly_totals@v2\s+serving", status), status
        rows = walk.run(f'bin/kappa query "SELECT count(*) AS n FROM {view}"', where="query v2")
        assert int(re.search(r"│\s*(\d+)\s*│", rows).group(1)) > 0, rows
        registry, alias = Registry(lake), ServingAlias(lake)
        assert registry.get(view, 2).state == "serving" and registry.get(view, 1).state == "retired"
        assert (alias.target(view).version, alias.target("campaign_hourly_totals").version) == (2, 2)
        assert alias.target(view).table_path.startswith(lake), alias.target(view)

        walk.run(f"bin/kappa rollback {view} --to 1 --cascade", where="rollback")
        assert (alias.target(view).version, alias.target("campaign_hourly_totals").version) == (1, 1)
        assert registry.get(view, 1).state == "serving" and registry.get(view, 2).state == "retired"
        status = walk.run("bin/kappa status", where="status after the rollback")
        assert re.search(rf"{view}@v1\s+running", status), status
    finally:
        down = subprocess.run(["make", "down"], cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
        print("\n".join(walk.transcript))
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (home / "lake").exists(), "part of the lake was written to the local disk"
