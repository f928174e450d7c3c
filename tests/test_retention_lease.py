"""Retention leases (kappa.control.leases): a replay in flight keeps the log it has not read yet.

Real broker (segments rolled and deleted by its own retention, checked every 5 s), real registry, a real replay job.
The topic is declared with an 8 s retention through a copy of the platform file (``KAPPA_PLATFORM``).
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from kappa.config import Settings
from kappa.control import replay
from kappa.control.leases import active_leases, converge_topics, leases, take
from kappa.control.registry import Registry
from kappa.control.replay.request import ReplayRequest
from kappa.log import generator
from kappa.log.topics import declared_topics, describe, ensure_topics, partition_offsets
from tests.conftest import subprocess_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
RETENTION_MS = "8000"


def _short_retention(tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """ad-events declared with an 8 s retention and 1 s segments (so closed segments exist to delete); no
    retention.bytes declared (a lease's undeclared key must go away again, not stay behind)."""
    platform = yaml.safe_load((REPO / "kappa" / "platform.yaml").read_text())
    config = platform["topics"]["ad-events"]["config"]
    config.pop("retention.bytes")
    config.update({"retention.ms": RETENTION_MS, "segment.ms": "1000"})
    path = tmp_path / "platform.yaml"
    path.write_text(yaml.safe_dump(platform, sort_keys=False))
    monkeypatch.setenv("KAPPA_PLATFORM", str(path))
    settings = settings.replace(platform=path)
    for key, value in subprocess_env(settings).items():
        if key.startswith("KAPPA_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("KAPPA_RUNNER", "local")
    # the topic was created from the real declaration: drop its retention.bytes override (None removes it)
    ensure_topics(settings, declared_topics(settings), held={settings.topic("ad-events"): {"retention.bytes": None}})
    return settings


def _retention(settings: Settings, topic: str) -> tuple[str | None, str | None, str | None]:
    """(retention.ms, retention.bytes in effect, the topic's own retention.bytes override or None)."""
    info = describe(settings, topic)
    return info.config.get("retention.ms"), info.config.get("retention.bytes"), info.overrides.get("retention.bytes")


HELD = ("-1", "-1")


def _log_start(settings: Settings, topic: str) -> dict[int, int]:
    return {p: low for p, (low, _high) in partition_offsets(settings, topic).items()}


@pytest.mark.slow  # make test-long: a replay slowed on purpose against a short retention; the lease's life cycle
# (taken, renewed, expired, ended) runs in make test in the tests below
@pytest.mark.timeout(900)
def test_a_slowed_replay_loses_nothing_to_retention_and_retention_comes_back(kafka, lake, tmp_path, monkeypatch):
    from deltalake import DeltaTable

    from kappa.control.runners.local import LocalRunner

    settings = _short_retention(tmp_path, lake.replace(home=tmp_path / "home"), monkeypatch)
    topic = settings.topic("ad-events")
    assert _retention(settings, topic) == (RETENTION_MS, "-1", None)
    sent = 0

    def produce(n: int, seed: int) -> None:  # Kafka stamps them now (CreateTime); a segment rolls after 1 s
        nonlocal sent
        records = generator.events(n, seed=seed, start_ms=int(time.time() * 1000), rate_per_s=5000)
        assert generator.produce(settings, topic, records).delivered == n
        sent += n

    for burst in range(2):  # two bursts 1.2 s apart: closed segments in every partition
        produce(1000, seed=burst)
        time.sleep(1.2)
    loaded = time.monotonic()

    runner = LocalRunner(settings)
    view = "events_raw"
    # slowed: 80 records per micro-batch, ~25 batches of 1.5-3 s - longer than the topic keeps a closed segment
    req = ReplayRequest(view=view, version=1, max_offsets_per_trigger=80, max_lag=0, triggered_by="test")
    try:
        replay.launch(req, settings, runner, replay.preflight(req, settings, runner))
        assert _retention(settings, topic)[:2] == HELD, "the lease holds the topic's retention"
        (lease,) = active_leases(settings)
        assert (lease.topic, lease.view, lease.version, lease.by) == (topic, view, 1, "test")
        converge_topics(settings)  # convergence while the lease holds does not shorten retention
        assert _retention(settings, topic)[:2] == HELD

        tick = 0
        while time.monotonic() - loaded < 8 + 5 + 3:  # the records outlive the 8 s retention and the broker's
            # 5 s check runs after that while the lease holds: without it, the closed segments would go here
            produce(10, seed=100 + tick)  # a live trickle keeps rolling segments
            tick += 1
            time.sleep(2)
        assert Registry(settings.lake_uri).get(view, 1).state == "building", "the replay was not slow enough"
        assert replay.progress(view, 1, settings).ratio < 1.0
        assert set(_log_start(settings, topic).values()) == {0}, "retention deleted records the replay needed"

        verdict = replay.follow(req, settings, runner, timeout=600)
        assert verdict.done, verdict.reason
        # caught up: the lease ended, the declared retention is back and the undeclared key is gone again
        assert active_leases(settings) == []
        (ended,) = leases(settings)
        assert ended.released_at is not None and ended.note.startswith("caught up"), ended
        assert _retention(settings, topic) == (RETENTION_MS, "-1", None)

        # nothing lost or doubled: every record produced is in the table once (counted from what was sent)
        rows = DeltaTable(replay.ViewVersion.resolve(view, 1, settings).paths.table).scan().read_all()
        keys = list(zip(rows.column("partition").to_pylist(), rows.column("offset").to_pylist()))
        assert len(keys) == len(set(keys)) == sent

        # and the restored retention does delete: the broker was able to all along (a control for the check above)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not any(_log_start(settings, topic).values()):
            produce(10, seed=200)  # new records roll the active segments
            time.sleep(3)
        assert any(_log_start(settings, topic).values()), "retention never deleted anything"
    finally:
        runner.stop(view, 1)


def test_a_lease_whose_replay_shows_no_life_expires_and_a_failed_one_ends(kafka, lake, tmp_path, monkeypatch):
    # a TTL long enough that registering and taking both leases under load stays inside it
    settings = _short_retention(tmp_path, lake.replace(home=tmp_path / "home"), monkeypatch).replace(
        lease_ttl_seconds=12)
    topic = settings.topic("ad-events")
    registry = Registry(settings.lake_uri)
    for view in ("events_raw", "user_sessions"):
        vv = replay.ViewVersion.resolve(view, 1, settings)
        registry.register(view, 1, code_module=vv.module, table_path=vv.paths.table, app_id=f"kappa:{view}@v1:t",
                          starting="earliest", triggered_by="test")
        take(settings, topic, view, 1, by="test")  # as a launch does; no job ever runs: a driver that crashed
    assert {lease.view for lease in active_leases(settings)} == {"events_raw", "user_sessions"}
    assert _retention(settings, topic)[:2] == HELD

    registry.set_state("user_sessions", 1, "failed", by="test", note="job failed")
    assert {lease.view for lease in active_leases(settings)} == {"events_raw"}  # the failed one ended
    converge_topics(settings)
    assert _retention(settings, topic)[:2] == HELD, "one lease still holds the topic"

    time.sleep(13)  # > KAPPA_LEASE_TTL_SECONDS without a commit or a run.json
    changes = converge_topics(settings)
    assert [c.topic for c in changes] == [topic], changes
    assert _retention(settings, topic) == (RETENTION_MS, "-1", None)
    notes = {lease.view: lease.note for lease in leases(settings)}
    assert notes["user_sessions"] == "its version is failed"
    assert notes["events_raw"].startswith("expired: its run committed nothing for"), notes


def test_view_stop_ends_the_lease_of_the_replay_it_stops_and_status_says_the_job_stopped(kafka, lake, tmp_path,
                                                                                          monkeypatch):
    """A replay stopped by hand holds nothing: `view stop` ends its lease (the declared retention is back at
    once, not after KAPPA_LEASE_TTL_SECONDS) and `status` shows the version as building with its job stopped;
    `topics leases` prints the whole view version and topic, however narrow the terminal."""
    import subprocess
    import sys

    settings = _short_retention(tmp_path, lake.replace(home=tmp_path / "home"), monkeypatch)
    view, topic = "campaign_window_counts", settings.topic("ad-events")
    vv = replay.ViewVersion.resolve(view, 2, settings)
    Registry(settings.lake_uri).register(view, 2, code_module=vv.module, table_path=vv.paths.table,
                                         app_id=f"kappa:{view}@v2:t", starting="earliest", triggered_by="test")
    take(settings, topic, view, 2, by="test")  # as its launch did
    assert _retention(settings, topic)[:2] == HELD
    env = {**subprocess_env(settings), "KAPPA_CLI": "bin/kappa"}

    def kappa(*args: str, columns: int = 60) -> str:
        proc = subprocess.run([sys.executable, "-m", "kappa.front.cli", *args], cwd=REPO, text=True,
                              env={**env, "COLUMNS": str(columns)}, capture_output=True, timeout=180)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stdout

    out = kappa("topics", "leases")  # the whole view version and topic, however narrow the terminal
    assert out.startswith(f"{view}@v2 on {topic}: holds retention (taken ") and "…" not in out, out
    out = kappa("view", "stop", view, "--version", "2")
    assert f"{view}@v2 on {topic}: retention lease released" in out, out
    assert f"resume it with `bin/kappa replay {view} --version 2`" in out, out
    assert active_leases(settings) == [] and _retention(settings, topic) == (RETENTION_MS, "-1", None)
    (ended,) = leases(settings)
    assert ended.note == "its job was stopped (view stop)"
    out = kappa("status", columns=120)
    assert re.search(rf"{view}@v2\s+building, job stopped\s", out), out
    out = kappa("status")  # narrow: the other columns wrap, the version stays whole
    assert re.search(rf"\s{view}@v2\s+building, job", out) and "…" not in out, out
    out = kappa("topics", "leases")
    assert re.match(rf"{view}@v2 on {re.escape(topic)}: ended \S+ \S+: its job was stopped \(view stop\) \(taken ",
                    out) and "holds retention" not in out, out


def _register(settings: Settings, view: str, version: int) -> None:
    vv = replay.ViewVersion.resolve(view, version, settings)
    Registry(settings.lake_uri).register(view, version, code_module=vv.module, table_path=vv.paths.table,
                                         app_id=f"kappa:{view}@v{version}:t", starting="earliest", triggered_by="test")


def test_a_relaunch_racing_the_expiry_of_its_lease_always_ends_up_holding_it(kafka, lake, tmp_path):
    """A replay relaunched (its launch takes the lease again) while the scheduled convergence ends the same lease
    as expired: whichever commits first, the relaunch holds its lease afterwards and the topic keeps the lease's
    retention. Each round starts from a lease past its TTL that nothing ended yet (its driver died)."""
    import threading

    settings = lake.replace(home=tmp_path / "home", lease_ttl_seconds=4)
    view, topic = "events_raw", settings.topic("ad-events")
    _register(settings, view, 1)
    take(settings, topic, view, 1, by="launch")
    for round_ in range(4):
        time.sleep(4.5)  # past the TTL: no run ever committed, the lease is expired but not ended yet
        barrier = threading.Barrier(2)
        out: dict[str, object] = {}

        def run(name: str, fn) -> None:
            barrier.wait()
            try:
                out[name] = fn()
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                out[name] = exc

        threads = [threading.Thread(target=run, args=("relaunch", lambda: take(settings, topic, view, 1,
                                                                              by=f"relaunch-{round_}"))),
                   threading.Thread(target=run, args=("retire", lambda: converge_topics(settings)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(isinstance(v, Exception) for v in out.values()), out
        assert out["relaunch"].released_at is None, out["relaunch"]
        (lease,) = leases(settings)
        assert lease.released_at is None, f"round {round_}: the relaunch's lease was ended under it: {lease}"
        assert [held.key for held in active_leases(settings, end_expired=False)] == [lease.key]
        assert _retention(settings, topic)[:2] == HELD, f"round {round_}: retention came back under the lease"


def test_leases_an_earlier_release_wrote_only_to_the_history_are_read_from_it(kafka_settings, tmp_path):
    """A lake whose leases were kept only in the append-only history (earlier releases): its lease table is created
    from the history's latest event per lease, so a replay in flight during the upgrade keeps its lease."""
    from deltalake import write_deltalake

    from kappa.control.leases import _HISTORY, _uri
    from kappa.runtime.deltars import arrow_rows, create_table

    settings = kafka_settings.replace(lake_uri=str(tmp_path / "lake"))
    uri = _uri(settings, "leases")
    create_table(uri, _HISTORY)
    at = [datetime(2026, 1, 1, 0, minute, tzinfo=UTC) for minute in range(4)]
    rows = [("t1", "a", 1, "taken", at[0], None), ("t1", "b", 2, "taken", at[1], None),
            ("t1", "b", 2, "released", at[2], "caught up"), ("t2", "a", 1, "taken", at[3], None)]
    write_deltalake(uri, arrow_rows(_HISTORY, [dict(zip(("topic", "view", "version", "event", "at", "note"), r),
                                                    by="old") for r in rows]), mode="append")
    got = {(lease.topic, lease.view, lease.version): (lease.taken_at, lease.released_at, lease.note)
           for lease in leases(settings)}
    assert got == {("t1", "a", 1): (at[0], None, None), ("t1", "b", 2): (at[1], at[2], "caught up"),
                   ("t2", "a", 1): (at[3], None, None)}
