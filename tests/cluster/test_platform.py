"""The whole platform in real containers on the real node: ``helm install`` of the local example with the images
built here, then the pods' own work - rows in every view's Delta table - read from outside the cluster.

The tests of this module run in order and share one release (the session fixture ``release`` of conftest.py,
which test_platform_faults.py goes on with): install, rows, analyst
query, a replay through the in-cluster Airflow, ``helm upgrade`` after its promote, a rollback and an upgrade after
it. Timings are printed (``-rP``) and saved to ``reports/cluster.json``; nothing here asserts a duration.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from kappa.catalog import load_catalog
from tests.cluster.conftest import NS, RELEASE, ROOT, Node, Release
from tests.docs_blocks import cluster_block

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

def test_every_pod_is_ready_and_runs_as_its_chart_user(release: Release) -> None:
    pods = release.node.get("pods", "-n", NS)["items"]
    running = [p for p in pods if p["status"]["phase"] == "Running"]
    names = {p["metadata"]["labels"].get("app.kubernetes.io/name") for p in running}
    for expected in ("kappa-kafka", "kappa-views", "kappa-producer", "kappa-postgresql", "kappa-airflow-api-server",
                     "kappa-airflow-scheduler", "kappa-airflow-dag-processor", "kappa-airflow-triggerer"):
        assert expected in names, f"{expected} not running: {sorted(n for n in names if n)}"
    for p in running:
        ready = {c["type"]: c["status"] for c in p["status"]["conditions"]}
        assert ready.get("Ready") == "True", f"{p['metadata']['name']}: {p['status']['conditions']}"
        for c in p["status"]["containerStatuses"]:
            assert c["restartCount"] <= 3, f"{p['metadata']['name']}/{c['name']} restarted {c['restartCount']} times"


def _counts(release: Release) -> dict[str, int]:
    """Rows of every view's serving table, read on the host through the registry's serving alias."""
    from kappa.front.query import QueryError, run_query

    counts = {}
    for view in load_catalog().views:
        try:
            counts[view] = int(run_query(f"SELECT count(*) FROM {view}", settings=release.settings()).rows[0][0])
        except QueryError:  # no serving table, or no commit yet
            counts[view] = 0
    return counts


def test_every_view_gets_rows_written_by_the_pods(release: Release) -> None:
    views = list(load_catalog().views)
    deadline = time.monotonic() + 900
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        counts = _counts(release)
        if all(counts.get(v, 0) > 0 for v in views):
            break
        time.sleep(5)
    print(f"rows per view: {counts}")
    assert all(counts.get(v, 0) > 0 for v in views), counts
    release.record("helm install -> rows in every view", time.monotonic() - release.installed_at)


def _run_block(release: Release, block, timeout: float) -> subprocess.CompletedProcess:
    """A docs block, verbatim, in the shell the install block left (its KUBECONFIG and pinned kubectl); it must
    succeed."""
    return _run_shell(release.node, block.text, block.where, timeout)


def _run_shell(node: Node, text: str, where: str, timeout: float) -> subprocess.CompletedProcess:
    """``text`` in bash from the checkout with the node's KUBECONFIG and pinned kubectl first on PATH; it must
    succeed (``where`` names it in the failure)."""
    env = {**node.env(), "PATH": f"{node.bin}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", text], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=timeout)
    assert res.returncode == 0, f"{where}: {res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


def test_an_analyst_outside_the_cluster_queries_the_views(release: Release) -> None:
    """`bin/kappa query` on the host, pointed at the lake volume (DuckDB over delta-rs, the serving versions): the
    docs' block, verbatim, in the shell the install block left (its KUBECONFIG and pinned kubectl)."""
    query = cluster_block("bin/kappa query")
    assert "bin/kappa query" in query.text, query.where
    res = _run_block(release, query, timeout=300)
    print(res.stdout)
    assert "campaign_window_counts: serving v1" in res.stdout, res.stdout
    assert res.stdout.count("│") > 10, "rows printed"


@contextlib.contextmanager
def _port_forward(node: Node, target: str, remote: int) -> Iterator[str]:
    """``kubectl port-forward`` to a Service of the release: the way an operator outside the cluster reaches it."""
    from kappa.log.broker import free_port

    port = free_port()
    proc = subprocess.Popen([str(node.bin / "kubectl"), "port-forward", "-n", NS, target, f"{port}:{remote}"],
                            env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else "port-forward exited"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _airflow(release: Release, url: str):
    from kappa.front.airflow_client import AirflowAPI

    secret = release.node.get("secret", f"{RELEASE}-airflow", "-n", NS)
    password = base64.b64decode(secret["data"]["admin-password"]).decode()
    return AirflowAPI(url, "admin", password)


def _serving(release: Release, view: str) -> int:
    from kappa.front.query import run_query

    return run_query(f"SELECT count(*) FROM {view}", settings=release.settings()).freshness[view].serving_version


def test_a_replay_through_the_in_cluster_airflow_runs_verifies_and_promotes(release: Release) -> None:
    """kappa_replay triggered through the in-cluster Airflow's REST API: the Kubernetes runner starts the new
    version's driver pod, it catches up, the recompute runs in the Airflow worker, the alias switches."""
    view, version = "campaign_window_counts", 2
    deployment = f"{RELEASE}-view-campaign-window-counts-v{version}"
    assert _serving(release, view) == 1
    # two cores run five live views, Airflow, the broker and now a replay: with the producer at 200 events/s the new
    # version's batches (a minute each here) never get within max_lag of the head. Paused, it catches up; the live
    # rate such a node sustains is for the benchmark, not this test.
    release.node.kubectl("scale", "-n", NS, f"deploy/{RELEASE}-producer", "--replicas=0")
    with contextlib.ExitStack() as undo, _port_forward(release.node, f"svc/{RELEASE}-airflow-api-server", 8080) as url:
        undo.callback(release.node.kubectl, "scale", "-n", NS, f"deploy/{RELEASE}-producer", "--replicas=1")
        api = _airflow(release, url)
        started = time.monotonic()
        run_id = api.trigger("kappa_replay", {"view": view, "version": version, "auto_promote": True,
                                              "watch_minutes": 0})
        seen: list[str] = []

        def progress(state) -> None:
            line = f"{time.monotonic() - started:6.0f} s {state.state}: " + ", ".join(
                f"{t}={s}" for t, s in state.tasks.items())
            seen.append(line)
            print(line)

        state = api.wait("kappa_replay", run_id, timeout=2700, poll=10, on_change=progress)
    assert state.state == "success", "\n".join(seen)
    release.record("kappa_replay trigger -> promoted (in-cluster Airflow)", time.monotonic() - started)

    driver = release.node.get("deployment", deployment, "-n", NS)
    assert driver["status"].get("readyReplicas") == 1, driver["status"]
    assert _serving(release, view) == version
    _eta_against_actual(release, view, version)


def _eta_against_actual(release: Release, view: str, version: int) -> None:
    """The ETAs wait_caught_up recorded (each progress sample's note in the registry's audit log) against the
    time the version actually reached ``caught_up``: printed and saved with the timings."""
    from kappa.control.registry import Registry

    events = Registry(str(release.lake())).events(view, version)
    done = next((e.at for e in events if e.to_state == "caught_up" and e.from_state == "building"), None)
    assert done is not None, [(e.from_state, e.to_state, e.note) for e in events]
    samples = [(e.at, e.note) for e in events
               if e.from_state == e.to_state == "building" and e.note and " ETA " in e.note and e.at < done]
    assert samples, "wait_caught_up recorded no progress sample before the version caught up"
    rows = []
    for at, note in samples:
        eta = _seconds(note.split(" ETA ", 1)[1].split(",", 1)[0])
        actual = (done - at).total_seconds()
        rows.append({"at": at.isoformat(), "eta_s": eta, "actual_s": round(actual, 1), "note": note})
        print(f"replay ETA at {at:%H:%M:%S}: {'unknown' if eta is None else f'{eta:.0f} s'}, "
              f"caught up {actual:.0f} s later  ({note})")
    known = [r for r in rows if r["eta_s"] is not None]
    assert known, "no sample had a rate to estimate from: " + "; ".join(r["note"] for r in rows)
    release.record_detail("replay ETA vs actual", rows)


def _seconds(text: str) -> float | None:
    """``42 s`` / ``3.5 min`` / ``1.2 h`` / ``unknown`` (kappa.control.replay.planning's human form) in seconds."""
    if text == "unknown":
        return None
    number, unit = text.split()
    return float(number) * {"s": 1, "min": 60, "h": 3600}[unit]


def _upgrade(release: Release) -> str:
    """docs/deploy.md's upgrade block, verbatim: helm upgrade with the install's values, then the runner's record."""
    block = cluster_block("helm upgrade")
    assert "helm upgrade" in block.text and "kappa-view-state" in block.text, block.where
    started = time.monotonic()
    res = _run_block(release, block, timeout=1800)
    print(f"helm upgrade: {time.monotonic() - started:.0f} s; record: {res.stdout.strip().splitlines()[-1]}")
    return res.stdout


def _hosted(release: Release) -> list[str]:
    d = release.node.get("deployment", f"{RELEASE}-views", "-n", NS)
    return d["metadata"]["annotations"]["kappa.io/views"].split(",")


def _wait_ready(release: Release, deployment: str, timeout: float = 900) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        d = release.node.get("deployment", deployment, "-n", NS)
        if d["status"].get("readyReplicas") == 1 and d["status"].get("updatedReplicas") == 1:
            return d
        assert time.monotonic() < deadline, f"{deployment} not Ready: {d['status']}"
        time.sleep(5)


def test_helm_upgrade_after_the_promote_keeps_serving_the_promoted_version(release: Release) -> None:
    """The runner stopped v1 inside the grouped driver and started v2 in a Deployment of its own; the record in
    kappa-view-state makes the next upgrade render exactly that: v1 not hosted again, v2 adopted unchanged."""
    view, old, new = "campaign_window_counts", "campaign_window_counts@v1", f"{RELEASE}-view-campaign-window-counts-v2"
    record = json.loads(release.node.get("configmap", f"{RELEASE}-view-state", "-n", NS)["data"]["views.json"])
    assert {v: e["state"] for v, e in record[view].items()} == {"1": "stopped", "2": "running"}, record
    # the grouped driver stops v1 once the kubelet refreshed the mounted record (about a minute)
    deadline = time.monotonic() + 300
    while f"{old} stopped in the host" not in release.node.kubectl("logs", "-n", NS, f"deploy/{RELEASE}-views",
                                                                     "--tail=-1").stdout:
        assert time.monotonic() < deadline, "the grouped driver did not hand v1 over"
        time.sleep(10)
    before = release.node.get("deployment", new, "-n", NS)["metadata"]
    assert old in _hosted(release)
    started = time.monotonic()
    _upgrade(release)
    release.record("helm upgrade after the promote", time.monotonic() - started)
    after = release.node.get("deployment", new, "-n", NS)["metadata"]
    assert (after["uid"], after["generation"]) == (before["uid"], before["generation"]), "v2 adopted unchanged"
    assert old not in _hosted(release) and len(_hosted(release)) == len(load_catalog().views) - 1
    manifest = release.node.run("helm", "get", "manifest", RELEASE, "-n", NS).stdout
    assert f"name: {new}" in manifest, "v2's driver is part of the release now"
    _wait_ready(release, f"{RELEASE}-views")
    assert _serving(release, view) == 2


def test_a_rollback_through_airflow_and_the_upgrade_after_it(release: Release) -> None:
    """kappa_rollback: v1 serves again in a Deployment of its own (the grouped driver no longer hosts it), v2's
    driver is deleted; the next upgrade keeps exactly that."""
    view = "campaign_window_counts"
    v1, v2 = (f"{RELEASE}-view-campaign-window-counts-v{n}" for n in (1, 2))
    with _port_forward(release.node, f"svc/{RELEASE}-airflow-api-server", 8080) as url:
        api = _airflow(release, url)
        started = time.monotonic()
        run_id = api.trigger("kappa_rollback", {"view": view, "to_version": 1})
        state = api.wait("kappa_rollback", run_id, timeout=900, poll=5)
    assert state.state == "success", state
    release.record("kappa_rollback trigger -> done", time.monotonic() - started)
    assert _serving(release, view) == 1
    uid = _wait_ready(release, v1)["metadata"]["uid"]
    release.node.kubectl("wait", "--for=delete", f"deployment/{v2}", "-n", NS, "--timeout=300s")
    _upgrade(release)
    assert release.node.get("deployment", v1, "-n", NS)["metadata"]["uid"] == uid
    assert "NotFound" in release.node.kubectl("get", "deployment", v2, "-n", NS, check=False).stderr
    assert f"{view}@v1" not in _hosted(release), "one driver per view version"
    before = _counts(release)[view]
    deadline = time.monotonic() + 600
    while _counts(release)[view] <= before:  # v1's own driver writes (the producer runs again)
        assert time.monotonic() < deadline, f"{view} v1 writes nothing after the rollback"
        time.sleep(10)


def test_pods_outside_the_release_reach_neither_the_broker_nor_airflow_nor_a_driver(release: Release) -> None:
    """The chart's NetworkPolicies, enforced on the node (kube-router): a pod in the release's namespace without the
    release's labels is refused by the broker, the Airflow API server, PostgreSQL and a view driver's metrics port;
    a pod carrying the platform's peer labels reaches the broker (and the platform itself works throughout)."""
    from tests.cluster.test_node import probe_pod

    driver_ip = release.node.get("pods", "-n", NS, "-l", f"app.kubernetes.io/name={RELEASE}-views")["items"][0][
        "status"]["podIP"]
    targets = [f"{RELEASE}-kafka:9092", f"{RELEASE}-airflow-api-server:8080", f"{RELEASE}-postgresql:5432",
               f"{driver_ip}:9400"]
    try:
        outsider = probe_pod(release.node, NS, "np-outsider", {"app": "outsider"}, targets)
        peer = probe_pod(release.node, NS, "np-peer", {"app.kubernetes.io/part-of": "kappa",
                                                       "app.kubernetes.io/instance": RELEASE}, targets[:1],
                         until_open=120)
    finally:
        release.node.kubectl("delete", "pod", "-n", NS, "np-outsider", "np-peer", "--wait=false", check=False)
    print(f"outsider: {outsider}; platform peer: {peer}")
    assert "open" not in outsider.values(), f"a pod outside the release got in: {outsider}"
    assert peer == {targets[0]: "open"}, peer


#: the SQL service's JDBC address inside the cluster, as docs/deploy.md ("Analysts' SQL endpoint") gives it
SQL_JDBC = f"jdbc:hive2://{RELEASE}-sql.{NS}.svc.cluster.local:10000/analytics"
#: an analyst's query: what serves each view, and a count from one of them
SQL_ASKED = ("SELECT view, serving_version FROM kappa.freshness ORDER BY view; "
             "SELECT count(*) AS n FROM analytics.events_raw;")


def _sql_token(release: Release) -> str:
    secret = release.node.get("secret", f"{RELEASE}-sql", "-n", NS)
    return base64.b64decode(secret["data"]["token"]).decode()


def _beeline_pod(release: Release, namespace: str, name: str, labels: dict[str, str], token: str | None,
                 ) -> tuple[str, str]:
    """An analyst's pod (the view-job image's beeline, nothing of the platform's own pods, no exec, no port-forward)
    running SQL_ASKED against SQL_JDBC: its phase (``Succeeded``/``Failed``) and its output. ``token`` None: the
    release's Secret through ``secretKeyRef``, as an analyst's pod in the release's namespace would mount it."""
    script = ('exec beeline -u "$JDBC" -n analyst -p "$KAPPA_SQL_TOKEN" --silent=true --outputformat=csv2 '
              '-e "$SQL"')
    return _client_pod(release, namespace, name, labels, token, ["sh", "-c", script], "view-job",
                       {"HOME": "/tmp", "JDBC": SQL_JDBC, "SQL": SQL_ASKED, "SPARK_BEELINE_MEMORY": "256m"}, "640Mi")


def _client_pod(release: Release, namespace: str, name: str, labels: dict[str, str], token: str | None,
                command: list[str], image_name: str, env: dict[str, str], memory: str) -> tuple[str, str]:
    """A pod of ``image_name`` running ``command`` to its end with the SQL token in ``KAPPA_SQL_TOKEN`` (``token``
    None: from the release's Secret through ``secretKeyRef``): its phase (``Succeeded``/``Failed``) and its output."""
    from tests.cluster.test_node import pod

    spec = pod(name, command, restart="Never", labels=labels, env=env, image_name=image_name)
    container = spec["spec"]["containers"][0]
    container["env"].append({"name": "KAPPA_SQL_TOKEN", "value": token} if token is not None else
                            {"name": "KAPPA_SQL_TOKEN",
                             "valueFrom": {"secretKeyRef": {"name": f"{RELEASE}-sql", "key": "token"}}})
    # 50m: it fits beside the release (1.8 of the node's 2 CPUs requested once v1 runs in its own driver)
    container["resources"] = {"requests": {"cpu": "50m", "memory": memory}, "limits": {"cpu": "1", "memory": memory}}
    release.node.apply(json.dumps(spec), "-n", namespace)
    deadline = time.monotonic() + 300
    phase = ""
    while time.monotonic() < deadline:
        phase = release.node.get("pod", name, "-n", namespace).get("status", {}).get("phase", "")
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    logs = release.node.kubectl("logs", "-n", namespace, name, check=False)
    release.node.kubectl("delete", "pod", "-n", namespace, name, "--wait=false", check=False)
    assert phase in ("Succeeded", "Failed"), f"{namespace}/{name} still {phase!r} after 300 s: {logs.stdout[-2000:]}"
    return phase, logs.stdout + logs.stderr


def _answered(output: str) -> dict[str, int]:
    """SQL_ASKED's answer in beeline's csv2 output: {view: serving version} and ``"<count>"``: the count."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    rows = lines[lines.index("view,serving_version") + 1:lines.index("n")]
    answer = {view: int(version) for view, version in (row.split(",") for row in rows)}
    answer["<count>"] = int(lines[lines.index("n") + 1])
    return answer


def test_analysts_pods_query_the_sql_service_and_only_they_reach_it(release: Release, namespace: str) -> None:
    """The SQL service in the cluster, as docs/deploy.md ("Analysts' SQL endpoint") tells an analyst: a pod labelled
    ``kappa.io/sql-client: "true"`` in the release's namespace (the token from the Secret) and a pod of a namespace
    labelled ``kappa.io/sql-clients: "true"`` (the token handed in) query every serving view over JDBC at the
    Service's cluster address; a pod without the label, and a pod of an unlabelled namespace, do not reach either
    port (the chart's NetworkPolicy, enforced on the node); a labelled pod with a wrong token is refused by the
    service."""
    from tests.cluster.test_node import probe_pod

    token = _sql_token(release)
    ports = [f"{RELEASE}-sql.{NS}.svc.cluster.local:10000", f"{RELEASE}-sql.{NS}.svc.cluster.local:15002"]
    views = sorted(load_catalog().views)

    phase, out = _beeline_pod(release, NS, "sql-analyst", {"kappa.io/sql-client": "true"}, None)
    assert phase == "Succeeded", out[-3000:]
    mine = _answered(out)
    print(f"labelled pod in {NS}: {mine}")
    assert sorted(v for v in mine if v != "<count>") == views and mine["<count>"] > 0, out[-3000:]

    phase, out = _beeline_pod(release, NS, "sql-wrong-token", {"kappa.io/sql-client": "true"}, token + "x")
    assert phase == "Failed" and "Error validating the login" in out, out[-3000:]

    # kube-router applies a namespace's new label when it syncs (test_node.py: seconds): each side is tried until
    # it holds, for at most 180 s
    release.node.kubectl("label", "namespace", namespace, "kappa.io/sql-clients=true")
    labelled = time.monotonic()
    for attempt in range(10):
        phase, out = _beeline_pod(release, namespace, f"sql-team-{attempt}", {}, token)
        if phase == "Succeeded" or time.monotonic() - labelled > 180:
            break
    assert phase == "Succeeded", out[-3000:]
    theirs = _answered(out)
    print(f"pod of a labelled namespace (attempt {attempt + 1}): {theirs}")
    assert sorted(v for v in theirs if v != "<count>") == views and theirs["<count>"] >= mine["<count>"]

    release.node.kubectl("label", "namespace", namespace, "kappa.io/sql-clients-")
    unlabelled_at = time.monotonic()
    try:
        for attempt in range(20):
            unlabelled = probe_pod(release.node, NS, f"sql-outsider-{attempt}", {"app": "outsider"}, ports)
            elsewhere = probe_pod(release.node, namespace, f"sql-elsewhere-{attempt}", {"kappa.io/sql-client": "true"},
                                  ports)
            if "open" not in {*unlabelled.values(), *elsewhere.values()} or time.monotonic() - unlabelled_at > 180:
                break
    finally:
        release.node.kubectl("delete", "pod", "-n", NS, "-l", "app=outsider", "--wait=false", check=False)
    print(f"unlabelled pod in {NS}: {unlabelled}; labelled pod of an unlabelled namespace: {elsewhere} "
          f"(attempt {attempt + 1})")
    assert "open" not in unlabelled.values(), f"a pod without the label reached the SQL service: {unlabelled}"
    assert "open" not in elsewhere.values(), f"a pod of an unlabelled namespace reached the SQL service: {elsewhere}"


#: appended to the docs' Python block in the analyst's pod: the same session tries to write
PYTHON_WRITE = """
try:
    cursor.execute("INSERT INTO analytics.events_raw SELECT * FROM analytics.events_raw LIMIT 1")
    print("WRITE: accepted")
except Exception as e:  # the service's read-only guard
    print("WRITE: refused:", " ".join(str(e).split())[:400])
"""


def test_an_analysts_python_pod_queries_every_serving_view(release: Release) -> None:
    """docs/deploy.md's Python block, verbatim, in a pod of the analyst image (infra/images/analyst.Dockerfile: the
    laptop's lock, nothing of the platform), labelled as an analyst's in the release's namespace, the token from the
    Secret: every view answers at the Service's cluster address with the version the registry says serves (read on
    the host, delta-rs over the lake volume), and an INSERT from the same session is refused with the service's one
    line."""
    from tests.docs_blocks import python_block

    block = python_block("kappa-sql.kappa.svc.cluster.local")
    assert f"{RELEASE}-sql.{NS}.svc.cluster.local" in block.text, block.where
    phase, out = _client_pod(release, NS, "sql-python", {"kappa.io/sql-client": "true"}, None,
                             ["python", "-c", block.text + PYTHON_WRITE], "analyst", {}, "384Mi")
    print(out[-3000:])
    assert phase == "Succeeded", f"{block.where}: {out[-3000:]}"
    answered = {}
    for line in out.splitlines():
        view, sep, rest = line.partition(": v")
        if sep and " serves, " in rest:
            version, _, rows = rest.partition(" serves, ")
            answered[view] = (int(version), int(rows.split(" rows")[0]))
    assert sorted(answered) == sorted(load_catalog().views), out[-3000:]
    assert answered["events_raw"][1] > 0, answered
    serving = {view: _serving(release, view) for view in answered}
    assert {view: version for view, (version, _) in answered.items()} == serving, (answered, serving)
    assert "WRITE: refused: " in out and "kappa sql is read-only" in out, out[-3000:]


def test_the_docs_token_rotation_logs_the_old_token_out(release: Release) -> None:
    """docs/deploy.md's rotation block, verbatim (with the shell's KUBECONFIG and pinned kubectl): afterwards the old
    token is refused and the new one - read from the Secret, as an analyst is handed it - answers; a ``helm
    upgrade`` keeps the new one."""
    from tests.docs_blocks import shell_block

    block = shell_block("rollout restart deployment/kappa-sql")
    old = _sql_token(release)
    started = time.monotonic()
    _run_block(release, block, timeout=900)
    release.record("sql token rotated -> the service restarted", time.monotonic() - started)
    new = _sql_token(release)
    assert new != old and len(new) >= 32

    phase, out = _beeline_pod(release, NS, "sql-old-token", {"kappa.io/sql-client": "true"}, old)
    assert phase == "Failed" and "Error validating the login" in out, out[-3000:]
    phase, out = _beeline_pod(release, NS, "sql-new-token", {"kappa.io/sql-client": "true"}, new)
    assert phase == "Succeeded" and _answered(out)["<count>"] > 0, out[-3000:]

    _upgrade(release)
    assert _sql_token(release) == new, "helm upgrade replaced the rotated token"
