"""Views of views (Samza's pattern): campaign_window_counts publishes its final windows to a topic of its own,
campaign_hourly_totals reads it; a cascading replay rebuilds and switches both together.

* the two stages on the real broker, Spark and Delta: every final window of the upstream table is in the topic,
  exactly as stored; the hourly table equals its oracle over the topic's raw records AND, end to end, plain Python
  over the raw ad events (final windows of the upstream oracle summed per hour); a publish repeated after a
  simulated crash (its progress file removed: what a crash between the acks and the progress write leaves)
  puts copies of every window in the log and changes no row of the hourly table.
* ``kappa replay campaign_window_counts --version 2 --cascade --promote`` (the CLI, LocalRunner: the real view host
  runs the jobs) builds v2 and campaign_hourly_totals v2 over it, verifies both strictly and switches the pair in
  one alias commit: a reader of the alias table never sees v2 of one with v1 of the other; ``kappa rollback
  --cascade`` switches the pair back the same way. Refusals are one line. (``make test-long``: ``make test``'s
  first-hour walk runs the documented cascading replay through Airflow and checks the alias the same way.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.campaign_hourly_totals.oracle import HOUR_MS, hourly_totals_of_windows
from kappa.identity import ViewPaths
from kappa.log import generator
from kappa.runtime.view import load_view
from kappa.verify import oracle
from kappa.verify.oracle import OracleInput, epoch_ms
from tests.helpers import alias_pairs, recorded_batches, run_to_end

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000  # 13 min into an hour: the events span that hour (final at the end) and part of the next
UPSTREAM = "campaign_window_counts"
HOURLY = "campaign_hourly_totals"


def _load(settings, n: int, seed: int) -> None:
    u = generator.universe(seed=seed, campaigns=3, users=60)
    generator.publish_campaigns(settings, generator.campaign_records(u), topic=settings.topic("campaigns"))
    events = generator.events(n, seed=seed, universe=u, start_ms=T0, rate_per_s=0.35, late_fraction=0.05,
                              max_lateness_ms=40_000, malformed_fraction=0.03)
    assert generator.produce(settings, settings.topic("ad-events"), events).delivered == n


def _rows(spark, settings, view: str, version: int) -> list[dict]:
    return [r.asDict() for r in spark.read.format("delta").load(ViewPaths(settings.lake_uri, view, version).table)
            .collect()]


def _final_windows_of_raw_log(settings, version: int) -> dict[tuple[str, int], int]:
    """Plain Python over the raw ad events (the upstream's own oracle): final window -> views."""
    spec = oracle.oracle_for(UPSTREAM, version)
    events = oracle.validate_records(oracle.read_log(settings, settings.topic("ad-events")), "ad_event",
                                     key_field="user_id")
    campaigns = oracle.validate_records(oracle.read_log(settings, settings.topic("campaigns")), "campaign",
                                        key_field=None, tombstones=True)
    windows = spec.compute(OracleInput(events=events, lookups={"campaigns": campaigns},
                                       batches=recorded_batches(settings, UPSTREAM, version)))
    return {k: v[1] for k, v in windows.items() if v[-1]}  # (window end, views, ..., is_final)


def _hourly(rows: list[dict]) -> dict[tuple[str, int], int]:
    return {(r["campaign_id"], epoch_ms(r["hour_start"])): r["view_count"] for r in rows}


def test_two_stages_equal_their_oracles_and_the_raw_log(spark, kafka, lake):
    """v1 of both views, run over the log in small micro-batches: what the upstream published, the hourly table,
    and the hourly table again after every window was published a second time."""
    _load(lake, 1500, seed=31)
    _two_stages(spark, lake)


def _two_stages(spark, lake) -> None:
    from kappa.runtime.publish import PROGRESS_FILE, Publisher

    run_to_end(spark, lake, "jobs.campaign_window_counts.v1", batch=500)

    # every final window of the table is in the topic, as stored; nothing that is not final
    upstream = _rows(spark, lake, UPSTREAM, 1)
    final = {(r["campaign_id"], epoch_ms(r["window_start"])): r["view_count"] for r in upstream if r["is_final"]}
    assert final and len(final) < len(upstream), "some windows final, some still open"
    topic = lake.topic("campaign-windows.v1")
    published = oracle.validate_records(oracle.read_log(lake, topic), "campaign_window", key_field=None)
    assert all(v.error is None for v in published)
    assert {(v.value["campaign_id"], v.value["window_start"]): v.value["view_count"] for v in published} == final
    assert len(published) == len(final), "each window published once (no crash happened)"
    starts = [v.value["window_start"] for v in published]
    assert starts == sorted(starts), "published in event-time order"

    run_to_end(spark, lake, "jobs.campaign_hourly_totals.v1", batch=400)
    hourly = _rows(spark, lake, HOURLY, 1)
    spec = oracle.oracle_for(HOURLY, 1)
    expected = spec.compute(OracleInput(events=published, batches=recorded_batches(lake, HOURLY, 1)))
    actual = dict(spec.adapt(r) for r in hourly)
    assert actual == expected and len(actual) == len(hourly)
    assert any(v[-1] for v in expected.values()) and not all(v[-1] for v in expected.values()), \
        "one hour final, one still open"
    # end to end, independent of both jobs: the raw log's final windows summed per hour
    assert _hourly(hourly) == hourly_totals_of_windows(_final_windows_of_raw_log(lake, 1))
    assert {h for _c, h in _hourly(hourly)} == {T0 - T0 % HOUR_MS, T0 - T0 % HOUR_MS + HOUR_MS}

    # a crash between the acks and the progress write: the next publish sends every window again
    paths = ViewPaths(lake.lake_uri, UPSTREAM, 1)
    Path(paths.checkpoint, PROGRESS_FILE).unlink()
    assert Publisher(load_view("jobs.campaign_window_counts.v1"), lake, paths).publish() == len(final)
    assert len(oracle.read_log(lake, topic)) == 2 * len(final)
    run_to_end(spark, lake, "jobs.campaign_hourly_totals.v1", batch=400)
    assert _hourly(_rows(spark, lake, HOURLY, 1)) == _hourly(hourly), "a copy changed a total"
    late = spark.read.format("delta").load(paths.quarantine).where(f"view = '{HOURLY}' and error LIKE 'late%'")
    assert 0 < late.count() <= len(final), "the copies behind the watermark are kept as late, once each"


@pytest.mark.slow  # make test-long: make test's first-hour walk runs the docs' cascading replay through Airflow
@pytest.mark.timeout(1200)
def test_two_stages_then_a_cascading_replay_switches_the_chain_together(spark, kafka, lake, tmp_path, monkeypatch,
                                                                       capsys):
    from kappa.control.registry import Registry
    from kappa.control.runners.local import LocalRunner
    from kappa.front import cli
    from kappa.runtime.host import stop_host
    from tests.conftest import subprocess_env

    settings = lake.replace(home=tmp_path / "home")
    for key, value in subprocess_env(settings).items():
        if key.startswith("KAPPA_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("KAPPA_RUNNER", "local")
    monkeypatch.setenv("KAPPA_LOCAL_DRIVER", "host")  # the jobs run in the view host, as under `make run`
    _load(settings, 1500, seed=31)
    _two_stages(spark, settings)  # v1 of both serve (by default)

    def kappa(*argv: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exited:
            cli.main(list(argv))
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err
        return exited.value.code, out.out + out.err

    code, out = kappa("replay", UPSTREAM, "--version", "3", "--cascade", "--dry-run")
    assert code != 0 and "campaign_window_counts@v3 publishes nothing" in out and len(out.strip().splitlines()) == 1
    code, out = kappa("replay", UPSTREAM, "--version", "2", "--cascade", "--dry-run")
    assert code == 0 and "build campaign_hourly_totals@v2 over campaign_window_counts@v2" in out, out
    assert not Registry(settings.lake_uri).list(), "a dry run registers nothing"

    try:
        code, out = kappa("replay", UPSTREAM, "--version", "2", "--cascade", "--promote", "--watch-minutes", "0",
                          "--timeout", "600")
        assert code == 0, out
        assert "switched together: campaign_window_counts v2, campaign_hourly_totals v2 (one alias commit)" in out
        registry = Registry(settings.lake_uri)
        states = {(r.view, r.version): r.state for r in registry.list()}
        assert states == {(UPSTREAM, 1): "retired", (UPSTREAM, 2): "serving", (HOURLY, 1): "retired",
                          (HOURLY, 2): "serving"}, states
        pairs = alias_pairs(settings, UPSTREAM, HOURLY)
        assert pairs[-1] == (2, 2) and set(pairs) <= {(1, 1), (2, 2)}, f"readers saw a mixed chain: {pairs}"
        # end to end: the new chain equals plain Python over the raw ad events
        hourly = _hourly(_rows(spark, settings, HOURLY, 2))
        assert hourly and hourly == hourly_totals_of_windows(_final_windows_of_raw_log(settings, 2))

        code, out = kappa("rollback", UPSTREAM, "--to", "1", "--cascade")
        assert code == 0 and "(one alias commit)" in out, out
        # each step is said as it begins: the switch, then each replaced job's stop (it drains a micro-batch)
        assert "switched back in one alias commit" in out, out
        for view in (UPSTREAM, HOURLY):
            assert f"{view}@v2: stopping its job (after its running micro-batch" in out, out
        pairs = alias_pairs(settings, UPSTREAM, HOURLY)
        assert pairs[-1] == (1, 1) and set(pairs) <= {(1, 1), (2, 2)}, f"readers saw a mixed chain: {pairs}"
        runner = LocalRunner(settings, mode="host")
        assert {(v, n): runner.status(v, n).state for v, n in ((UPSTREAM, 1), (HOURLY, 1), (UPSTREAM, 2),
                                                                 (HOURLY, 2))} == {
            (UPSTREAM, 1): "running", (HOURLY, 1): "running", (UPSTREAM, 2): "stopped", (HOURLY, 2): "stopped"}
    finally:
        stop_host(settings)
