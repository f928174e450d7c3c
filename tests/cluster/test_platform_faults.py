"""Faults in the cluster, on the release test_platform.py installed (the session fixture ``release``): the view
driver pod force-deleted mid-batch several times (grace 0), the broker pod killed, the node's containerd and kubelet
killed and started again. After all of them, with the producer paused and the views caught up, the events_raw archive (run
by the grouped driver) holds every record of the log exactly once - counted independently (DuckDB over the Delta
tables on the node's disk against the broker's own end offsets) and by the project's verification (``kappa verify``
in the Airflow scheduler pod: recompute + plain-Python oracle).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import time

import pytest

from tests.cluster.conftest import NS, RELEASE, ROOT, Release, job_like, run_job

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

VIEW = "events_raw"
GROUPED = f"{RELEASE}-views"
KAFKA_POD = f"{RELEASE}-kafka-0"
KILLS = 3


def _table(release: Release) -> str:
    return str(release.lake() / "views" / VIEW / "v1" / "table")


def _delta_version(release: Release) -> int:
    from deltalake import DeltaTable

    return DeltaTable(_table(release)).version()


def _wait_commits(release: Release, after: int, what: str, timeout: float = 600) -> float:
    """Wait until events_raw's table gets a Delta version beyond ``after``; seconds waited."""
    started = time.monotonic()
    while _delta_version(release) <= after:
        assert time.monotonic() - started < timeout, f"no commit to {VIEW} after {what} ({timeout:.0f} s)"
        time.sleep(3)
    return time.monotonic() - started


def _pod(release: Release, deployment: str) -> dict:
    sel = ",".join(f"{k}={v}" for k, v in
                   release.node.get("deployment", deployment, "-n", NS)["spec"]["selector"]["matchLabels"].items())
    pods = [p for p in release.node.get("pods", "-n", NS, "-l", sel)["items"]
            if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def test_force_deleted_driver_pods_restart_from_their_checkpoints(release: Release) -> None:
    """`kubectl delete pod --grace-period=0 --force` of the grouped driver while it commits: the Deployment
    replaces it, every view in it resumes from its checkpoint (the exactly-once check is the last test)."""
    rng = random.Random(28)
    for i in range(KILLS):
        _wait_commits(release, _delta_version(release), f"kill {i} (before)")
        time.sleep(rng.uniform(0.5, 4.0))  # somewhere inside the next micro-batch
        victim = _pod(release, GROUPED)["metadata"]["name"]
        before = _delta_version(release)
        killed = time.monotonic()
        release.node.kubectl("delete", "pod", victim, "-n", NS, "--grace-period=0", "--force")
        deadline = killed + 900
        while True:
            pods = [p for p in release.node.get("pods", "-n", NS, "-l", f"app.kubernetes.io/name={GROUPED}")["items"]
                    if p["metadata"]["name"] != victim]
            if pods and _ready(pods[0]):
                break
            assert time.monotonic() < deadline, f"no Ready replacement of {victim}"
            time.sleep(3)
        ready = time.monotonic() - killed
        resumed = _wait_commits(release, before, f"kill {i}") + ready
        release.record(f"driver pod force-deleted #{i + 1} -> replacement Ready", ready)
        print(f"kill {i + 1}: {victim} -> Ready {ready:.0f} s, first commit {resumed:.0f} s")


def test_killing_the_broker_pauses_the_views_and_they_resume(release: Release) -> None:
    before = _delta_version(release)
    old = release.node.get("pod", KAFKA_POD, "-n", NS)["metadata"]["uid"]
    killed = time.monotonic()
    # killed (SIGTERM, SIGKILL a second later), not force-deleted: a StatefulSet's pod is recreated under the same
    # name only once the old one is gone, so two brokers never share the volume (a forced delete could)
    release.node.kubectl("delete", "pod", KAFKA_POD, "-n", NS, "--grace-period=1", "--wait=false")
    while True:  # the StatefulSet creates the pod again under the same name
        res = release.node.kubectl("get", "pod", KAFKA_POD, "-n", NS, "-o", "json", check=False)
        if res.returncode == 0 and json.loads(res.stdout)["metadata"]["uid"] != old:
            break
        assert time.monotonic() - killed < 300, "the StatefulSet did not recreate the broker's pod"
        time.sleep(2)
    release.node.wait_pod(NS, KAFKA_POD, timeout=600)
    back = time.monotonic() - killed
    resumed = _wait_commits(release, _delta_version(release), "the broker's restart") + back
    release.record("broker pod killed -> broker Ready", back)
    release.record("broker pod killed -> views commit again", resumed)
    assert _delta_version(release) > before
    driver = _pod(release, GROUPED)
    print(f"broker back in {back:.0f} s, {VIEW} commits again after {resumed:.0f} s; grouped driver restarts: "
          f"{driver['status']['containerStatuses'][0]['restartCount']}")


def test_containerd_and_kubelet_killed_and_restarted_pods_return(release: Release) -> None:
    """SIGKILL to containerd and the kubelet (a crashed runtime), then `node.sh up` starts them again: the pods'
    containers outlive them (their shims) and the restarted kubelet adopts them."""
    run = release.node.home / "run"
    before = {p["metadata"]["name"]: [c.get("containerID") for c in p["status"].get("containerStatuses", [])]
              for p in release.node.get("pods", "-n", NS)["items"] if p["status"].get("phase") == "Running"}
    version = _delta_version(release)
    for name in ("kubelet", "containerd"):
        pid = int((run / f"{name}.pid").read_text())
        subprocess.run(["kill", "-KILL", str(pid)], check=True)
    killed = time.monotonic()
    time.sleep(5)
    assert _delta_version(release) >= version  # the views keep running without the node agents
    subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "node.sh"), "up"], check=True, capture_output=True,
                   timeout=600)
    deadline = time.monotonic() + 600
    while True:
        pods = {p["metadata"]["name"]: p for p in release.node.get("pods", "-n", NS)["items"]}
        if all(n in pods and _ready(pods[n]) for n in before):
            break
        assert time.monotonic() < deadline, {n: pods.get(n, {}).get("status", {}).get("conditions") for n in before}
        time.sleep(3)
    release.record("containerd + kubelet killed -> every pod Ready again", time.monotonic() - killed)
    same = [n for n, ids in before.items()
            if [c.get("containerID") for c in pods[n]["status"].get("containerStatuses", [])] == ids]
    print(f"pods kept their containers across the runtime restart: {len(same)} of {len(before)}")
    _wait_commits(release, _delta_version(release), "the runtime restart")


def _end_offsets(release: Release, topic: str) -> dict[int, int]:
    out = release.node.kubectl("exec", "-n", NS, KAFKA_POD, "-c", "kafka", "--", "kafka-get-offsets.sh",
                               "--bootstrap-server", "localhost:9092", "--topic", topic, "--time", "-1").stdout
    return {int(p): int(o) for _t, p, o in (line.split(":") for line in out.split() if line.count(":") == 2)}


def test_after_every_fault_each_record_is_in_the_archive_exactly_once(release: Release) -> None:
    import duckdb
    from deltalake import DeltaTable

    release.node.kubectl("scale", "-n", NS, f"deploy/{RELEASE}-producer", "--replicas=0")
    try:
        release.node.kubectl("wait", "--for=delete", "pod", "-n", NS, "-l",
                             f"app.kubernetes.io/name={RELEASE}-producer", "--timeout=120s", check=False)
        ends = _end_offsets(release, "ad-events")
        expected = sum(ends.values())
        deadline = time.monotonic() + 900
        while True:  # caught up: every offset below the end is in the archive or the quarantine
            con = duckdb.connect()
            con.register("events", DeltaTable(_table(release)).scan().read_all())
            con.register("quarantine", DeltaTable(str(release.lake() / "quarantine")).scan().read_all())
            counts = con.sql("""
                WITH seen AS (
                    SELECT "partition" AS p, "offset" AS o FROM events WHERE topic = 'ad-events'
                    UNION ALL
                    SELECT "partition", "offset" FROM quarantine
                    WHERE "view" = 'events_raw' AND version = 1 AND topic = 'ad-events')
                SELECT p, count(*) AS n, count(DISTINCT o) AS d, min(o) AS lo, max(o) AS hi FROM seen GROUP BY p
                ORDER BY p""").fetchall()
            total = sum(n for _p, n, _d, _lo, _hi in counts)
            quarantined = con.sql("""SELECT count(*) FROM quarantine WHERE "view" = 'events_raw' AND version = 1
                                     AND topic = 'ad-events'""").fetchall()[0][0]
            if total >= expected or time.monotonic() > deadline:
                break
            time.sleep(10)
        print(f"log end offsets {ends}; archive per partition (rows, distinct, min, max): {counts}")
        assert {p: (n, d, lo, hi) for p, n, d, lo, hi in counts} == {p: (e, e, 0, e - 1) for p, e in ends.items() if e}, \
            "every offset of the log exactly once, none missing, none twice"

        # the project's verification, in a pod of the grouped driver's kind with room for the plain-Python oracle
        # over the whole log (the scheduler pod's 3 GiB, shared with the scheduler, was not enough: OOM-killed)
        logs = run_job(release.node, job_like(release.node, NS, GROUPED, f"{RELEASE}-verify-{VIEW.replace('_', '-')}",
                                              ["kappa", "verify", VIEW, "--version", "1"],
                                              {"KAPPA_SPARK_MASTER": "local[2]"}, memory="4Gi"), timeout=1800)
        print(logs[-1500:])
        found = re.search(r"events_raw@v1: ([\d,]+) rows equal the recompute and the oracle", logs)
        assert found and int(found.group(1).replace(",", "")) == sum(n for _p, n, *_ in counts) - quarantined, \
            logs[-3000:]
    finally:
        release.node.kubectl("scale", "-n", NS, f"deploy/{RELEASE}-producer", "--replicas=1")
    print(json.dumps(release.timings, indent=1))
