"""Broker faults while views run: SIGKILL the broker, SIGSTOP it for longer than a consumer session, bring it
back; every view ends equal to the oracle (nothing lost, nothing doubled), and the jobs' metrics show the outage.

The broker is the test's own (a second real KRaft broker, its own ports and data), so killing it leaves the
session's broker alone. The four views run in one view host (one JVM), as ``make run`` runs them. ``make
test-long`` runs it (``slow``): about six minutes on 2 cores, most of it the outages themselves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kappa.log import generator
from kappa.log.broker import LocalBroker, free_port
from kappa.log.topics import declared_topics, ensure_topics, partition_offsets
from kappa.runtime.checkpoint import last_commit
from kappa.identity import ViewPaths
from kappa.runtime.view import declared_view
from tests.conftest import subprocess_env
from tests.crashloop import VIEWS
from tests.views_oracle import assert_views_match

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _gauge(url: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def _load(settings, n: int, seed: int, start_ms: int, u) -> None:
    stream = generator.events(n, seed=seed, universe=u, start_ms=start_ms, rate_per_s=40, late_fraction=0.05,
                              max_lateness_ms=60_000, malformed_fraction=0.05)
    assert generator.produce(settings, settings.topic("ad-events"), stream).delivered == n


def _caught_up(settings, timeout: float) -> None:
    """Every view committed a micro-batch ending at its stream topic's log end."""
    topics = {v: settings.topic(declared_view(v, 1).stream_topic) for v in VIEWS}
    ends = {t: {p: high for p, (_low, high) in partition_offsets(settings, t).items()} for t in set(topics.values())}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(last_commit(f"{ViewPaths(settings.lake_uri, v, 1).checkpoint}/main", t)[0] == ends[t]
               for v, t in topics.items()):
            return
        time.sleep(2)
    raise AssertionError(f"views not caught up with {ends} after {timeout:.0f} s")


@pytest.mark.timeout(1800)
def test_views_wait_out_a_killed_and_a_frozen_broker_and_equal_the_oracle(spark, lake, tmp_path):
    port = free_port()
    broker = LocalBroker(tmp_path / "broker", port=port, controller_port=free_port(), heap="512m",
                         jars_dir=lake.jars_dir / "broker").start()
    settings = lake.replace(kafka_bootstrap=broker.bootstrap, home=tmp_path / "home")
    ensure_topics(settings, declared_topics(settings))
    u = generator.universe(seed=5, campaigns=10, users=300)
    generator.publish_campaigns(settings, generator.campaign_records(u), topic=settings.topic("campaigns"))
    _load(settings, 2000, 1, 1_700_200_000_000, u)

    metrics = free_port()
    args = [sys.executable, "-m", "kappa.runtime.driver", "host", "--metrics-port", str(metrics)]
    for view in VIEWS:
        args += ["--view", f"{view}@v1", "--starting", "earliest"]
    log = tmp_path / "host.log"
    host = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=subprocess_env(settings, KAPPA_HOST_MAX_RESTARTS="2"), start_new_session=True)
    url = f"http://127.0.0.1:{metrics}/metrics"  # the first view's (events_raw) endpoint
    seen: list[float] = []
    stop = threading.Event()

    def scrape() -> None:  # what a Prometheus would have seen, every second
        while not stop.wait(1.0):
            value = _gauge(url, "kappa_kafka_reachable")
            if value is not None:
                seen.append(value)

    scraper = threading.Thread(target=scrape, daemon=True)
    try:
        _caught_up(settings, 300)
        scraper.start()

        # 1. SIGKILL: the broker is gone for 40 s (its data stays on disk), then starts again on the same ports
        os.kill(broker.pid, signal.SIGKILL)
        time.sleep(40)
        down = _gauge(url, "kappa_kafka_unreachable_seconds")
        assert host.poll() is None, "the host exited during the outage"
        broker = LocalBroker(tmp_path / "broker", port=port, controller_port=broker.controller_port, heap="512m",
                             jars_dir=lake.jars_dir / "broker").start()
        _load(settings, 1500, 2, 1_700_200_060_000, u)
        _caught_up(settings, 300)

        # 2. SIGSTOP for 60 s (> the 45 s consumer session timeout): connections stay open, nothing answers
        os.kill(broker.pid, signal.SIGSTOP)
        time.sleep(60)
        assert host.poll() is None, "the host exited while the broker was frozen"
        os.kill(broker.pid, signal.SIGCONT)
        _load(settings, 1500, 3, 1_700_200_120_000, u)
        _caught_up(settings, 300)
        stop.set()

        assert down is not None and down >= 20, f"kappa_kafka_unreachable_seconds during the outage: {down}"
        assert 0.0 in seen and seen[-1] == 1.0, f"kappa_kafka_reachable never showed the outage: {seen}"
        text = log.read_text(errors="replace")
        assert "failed 3 times in a row" not in text, "a view exhausted its restarts during the outage"
    finally:
        stop.set()
        try:
            os.killpg(host.pid, signal.SIGTERM)
            host.wait(120)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(host.pid, signal.SIGKILL)
    stats = assert_views_match(spark, settings)
    print(f"outage seen by the scraper: {seen.count(0.0)} s unreachable of {len(seen)} s; stats={stats}")
    broker.stop()
