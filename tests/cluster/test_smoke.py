"""The cluster smoke (marker ``smoke``, ``make test-smoke``): docs/deploy.md section 5 as a
user runs it, every ``docs-test: cluster`` block verbatim and in order, on a fresh cluster with fresh volumes and
the DAG's defaults.

1. the install block: ``make cluster-up`` (the node from the cached binaries), ``make images`` (incremental),
   ``node.sh load``, ``helm install --wait``; every pod Ready, as its chart user;
2. rows in every view's Delta table (read on the host), then the analyst's query block, then the analyst's SQL
   block (a port-forward to the SQL service left running; beeline over JDBC and the Spark Connect client, the token
   from the Secret): ``kappa.freshness`` says v1 serves;
3. the replay block: a port-forward left running, ``kappa_replay`` of ``campaign_window_counts`` v2 with
   ``auto_promote`` and the default watch window, ``--wait``: promoted, watched, and still serving after it - and
   the SQL block says v2 serves, from the same SQL pod, never restarted;
4. the upgrade block (the record: v1 stopped, v2 running), the rollback block (v1 serving again in its own driver,
   v2's deleted, every pod Ready; the SQL block says v1, same pod), the upgrade block again;
5. the clean-up block (``helm uninstall``, ``kubectl delete namespace``, ``node.sh recycle``, ``make
   cluster-down``), after which nothing of the node is left on the machine (``node.sh leftovers``: no process, bridge,
   network namespace, veth, mount, iptables chain or ipset).

Each block runs in its own bash (``-euo pipefail``) in the repository, after the install block's own ``export``
line - the shell the docs' reader has. A block that leaves a process behind (the SQL and replay blocks' port-forwards) is
stopped with its process group at the end. The pods' memory (working set, the kubelet's ``/stats/summary``) is
sampled throughout; timings and memory go to ``reports/smoke.json`` (docs/deploy.md, "Measured here").

An earlier cluster in this checkout's ``.kappa/cluster`` (a failed smoke, ``make test-cluster``'s release) is
reset first (``node.sh reset``: its etcd, volumes and pods go, the loaded images stay). A machine that cannot run a
node (not root, no cgroups) fails this test in one line saying why; it is never skipped. When a step fails, the
pods' state and logs are printed and the node is stopped (``KAPPA_SMOKE_KEEP=1`` leaves it running to look at).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.docs_blocks import Block, cluster_block, cluster_blocks
from tests.sql_client import Client

ROOT = Path(__file__).resolve().parents[2]
NS = "kappa"
VIEW = "campaign_window_counts"
NODE = "kappa-node"
HOME = ROOT / ".kappa" / "cluster"
LOGS = ROOT / ".cache" / "smoke"
REPORT = ROOT / "reports" / "smoke.json"
#: the DAG's default watch window (dags/kappa_replay.py, watch_minutes), which the replay block leaves as it is
WATCH_MINUTES = 10

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(4200)]


def node_sh(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "node.sh"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


class Operator:
    """The docs' reader, in one terminal: runs blocks in bash in the repository, each with the exports of every
    block before it (the install block's KUBECONFIG, the replay block's Airflow password), and what a block left
    running in the background (the port-forward) stays up for the next ones."""

    def __init__(self) -> None:
        install = cluster_block("helm install")
        self.exports = "".join(line + "\n" for line in install.text.splitlines() if line.startswith("export "))
        assert "KUBECONFIG=" in self.exports, install.where
        self.groups: list[int] = []
        self.timings: dict[str, float] = {}
        self.step = ""  # the block running now (the memory samples say in which block they were taken)
        LOGS.mkdir(parents=True, exist_ok=True)

    def run(self, block: Block, name: str, timeout: float, *, first: bool = False) -> str:
        """Run ``block`` verbatim; its output (stdout and stderr). Fails with the output's tail."""
        script = block.text if first else self.exports + block.text
        log = LOGS / f"{name}.log"
        started = time.monotonic()
        self.step = name
        with log.open("w") as out:
            # a session of its own: what the block leaves running in the background is stopped with its group
            # a wide terminal: the CLI's lines of task states are not wrapped
            proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "COLUMNS": "300"})
            self.groups.append(proc.pid)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop(proc.pid)
                rc = None
        took = time.monotonic() - started
        self.timings[name] = round(took, 1)
        text = log.read_text(errors="replace")
        if not first:
            self.exports += "".join(line + "\n" for line in block.text.splitlines() if line.startswith("export "))
        print(f"[smoke] {name} ({block.where}): {took:.0f} s, exit {rc}")
        assert rc == 0, (f"{block.where} ({name}) {'timed out' if rc is None else f'exited {rc}'} after {took:.0f} s; "
                         f"its output ({log}) ends:\n{text[-4000:]}")
        return text

    def stop(self, pgid: int) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            time.sleep(2)

    def stop_all(self) -> None:
        for pgid in self.groups:
            self.stop(pgid)


class Cluster:
    """kubectl against the node, as the blocks' shell has it."""

    def __init__(self) -> None:
        self.bin = Path(subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "build.sh")], capture_output=True,
                                       text=True, check=True).stdout.strip())
        self.env = {**os.environ, "KUBECONFIG": str(HOME / "admin.kubeconfig")}

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        res = subprocess.run([str(self.bin / "kubectl"), *args], capture_output=True, text=True, env=self.env,
                             cwd=ROOT, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {res.stderr.strip()[:1000]}")
        return res

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def lake(self) -> Path:
        pvc = self.get("pvc", "kappa-lake", "-n", NS)
        return Path(self.get("pv", pvc["spec"]["volumeName"])["spec"]["local"]["path"])

    def pods(self) -> list[dict]:
        return self.get("pods", "-n", NS)["items"]

    def not_ready(self) -> list[str]:
        """The release's long-running pods that are not Running and Ready (Jobs' pods aside)."""
        bad = []
        for p in self.pods():
            if p["status"].get("phase") == "Succeeded":
                continue
            ready = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}.get("Ready")
            if p["status"].get("phase") != "Running" or ready != "True":
                bad.append(f"{p['metadata']['name']} {p['status'].get('phase')} Ready={ready}")
        return bad

    def wait_all_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (bad := self.not_ready()) and time.monotonic() < deadline:
            time.sleep(5)
        assert not bad, f"pods not Ready after {timeout:.0f} s: {bad}"

    def memory(self) -> dict[str, tuple[int, int]]:
        """Per pod of the release (kubelet's /stats/summary), in bytes: its working set (what the limit and the
        eviction are measured against: anonymous memory and the active page cache) and its anonymous part
        (``rssBytes``; the rest of the working set is files it read or wrote)."""
        res = self.kubectl("get", "--raw", f"/api/v1/nodes/{NODE}/proxy/stats/summary", check=False, timeout=30)
        if res.returncode != 0:
            return {}
        out = {}
        for pod in json.loads(res.stdout).get("pods", []):
            ref, memory = pod["podRef"], pod.get("memory", {})
            if ref["namespace"] in (NS, "kube-system") and memory.get("workingSetBytes") is not None:
                out[_workload(ref["name"])] = (memory["workingSetBytes"], memory.get("rssBytes") or 0)
        return out

    def diagnostics(self) -> str:
        """What to look at when a step failed: pods, recent events, the tail of each unready pod's logs."""
        parts = [self.kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout,
                 self.kubectl("get", "events", "-n", NS, "--sort-by=.lastTimestamp", check=False).stdout[-4000:]]
        for line in self.not_ready():
            name = line.split()[0]
            logs = self.kubectl("logs", "-n", NS, name, "--all-containers", "--tail=40", check=False)
            parts.append(f"--- {name}\n{logs.stdout[-3000:]}{logs.stderr[-500:]}")
        sched = self.kubectl("logs", "-n", NS, "deploy/kappa-airflow-scheduler", "-c", "scheduler", "--tail=60",
                             check=False)
        parts.append(f"--- scheduler\n{sched.stdout[-4000:]}")
        # a restarted scheduler's previous container says why it stopped; the API server's slow requests, why a
        # client timed out (its access log has each request's duration)
        before = self.kubectl("logs", "-n", NS, "deploy/kappa-airflow-scheduler", "-c", "scheduler", "--previous",
                              "--tail=40", check=False)
        if before.returncode == 0:
            parts.append(f"--- scheduler, previous container\n{before.stdout[-3000:]}")
        api = self.kubectl("logs", "-n", NS, "deploy/kappa-airflow-api-server", "-c", "api-server", "--tail=400",
                           check=False)
        slow = [line for line in api.stdout.splitlines()
                if (m := re.search(r"duration_us=(\d+)", line)) and int(m.group(1)) > 5_000_000]
        parts.append("--- API server, requests slower than 5 s\n" + "\n".join(slow[-20:]))
        return "\n".join(parts)


def _workload(pod: str) -> str:
    """A pod's workload: a Deployment's pod without its ReplicaSet's and its own suffix, a Job's without its own;
    a StatefulSet's keeps its ordinal."""
    for pattern in (r"^(.+)-[a-z0-9]{8,10}-[a-z0-9]{5}$", r"^(.+)-[a-z0-9]{5}$"):
        if m := re.match(pattern, pod):
            return m.group(1)
    return pod


class MemorySampler(threading.Thread):
    """Samples every pod's working set every 20 s: the first sample a minute after the install, the maximum (with
    its anonymous part and the block it was taken in) and every sample of the grouped driver (``kappa-views``)."""

    def __init__(self, cluster: Cluster, operator: Operator) -> None:
        super().__init__(daemon=True)
        self.cluster, self.operator, self.stopping = cluster, operator, threading.Event()
        self.after_install: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.peak_at: dict[str, dict[str, Any]] = {}  # pod -> its peak's anonymous MiB, block and second
        self.grouped: list[list[Any]] = []  # [second, block, working set MiB, anonymous MiB] of kappa-views
        self.started = time.monotonic()

    def run(self) -> None:
        while not self.stopping.wait(20):
            try:
                sample = self.cluster.memory()
            except Exception:  # noqa: BLE001 - a sample lost while the API restarts is no finding
                continue
            second, step = round(time.monotonic() - self.started), self.operator.step
            if not self.after_install and second >= 60:
                self.after_install = {pod: used for pod, (used, _) in sample.items()}
            for pod, (used, anon) in sample.items():
                if used > self.peak.get(pod, 0):
                    self.peak[pod] = used
                    self.peak_at[pod] = {"anonymous_mib": round(anon / 2**20), "block": step, "second": second}
            if "kappa-views" in sample:
                used, anon = sample["kappa-views"]
                self.grouped.append([second, step, round(used / 2**20), round(anon / 2**20)])


def _mib(values: dict[str, int]) -> dict[str, int]:
    return {k: round(v / 2**20) for k, v in sorted(values.items())}


def _rows(lake: Path) -> dict[str, int]:
    """Rows of every view's serving table, read on the host through the registry's serving alias."""
    from kappa.catalog import load_catalog
    from kappa.config import Settings
    from kappa.front.query import QueryError, run_query

    settings = Settings.from_env({**os.environ, "KAPPA_LAKE_URI": str(lake)})
    counts = {}
    for view in load_catalog().views:
        try:
            counts[view] = int(run_query(f"SELECT count(*) FROM {view}", settings=settings).rows[0][0])
        except QueryError:  # no serving table yet, or no commit
            counts[view] = 0
    return counts


def _serving(lake: Path, view: str) -> int:
    from kappa.config import Settings
    from kappa.front.query import run_query

    settings = Settings.from_env({**os.environ, "KAPPA_LAKE_URI": str(lake)})
    return run_query(f"SELECT count(*) FROM {view}", settings=settings).freshness[view].serving_version


def _record(cluster: Cluster) -> dict[str, str]:
    cm = cluster.get("configmap", "kappa-view-state", "-n", NS)
    return {v: e["state"] for v, e in json.loads(cm["data"]["views.json"]).get(VIEW, {}).items()}


def _hosted(cluster: Cluster) -> list[str]:
    return cluster.get("deployment", "kappa-views", "-n", NS)["metadata"]["annotations"]["kappa.io/views"].split(",")


def _wait(what: str, check, timeout: float, every: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s"
        time.sleep(every)


def _report(operator: Operator, sampler: MemorySampler | None, total: float, result: str, extra: dict) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit.strip(), "result": result,
        "total_s": round(total, 1), "steps_s": operator.timings, **extra,
        "memory_mib_a_minute_after_install": _mib(sampler.after_install) if sampler else {},
        "memory_mib_peak": _mib(sampler.peak) if sampler else {},
        "memory_peak_when": dict(sorted(sampler.peak_at.items())) if sampler else {},
        "memory_grouped_driver_series": sampler.grouped if sampler else [],
    }, indent=2) + "\n")


#: what serves the replayed view, as the SQL service's catalog says
SERVING_SQL = f"SELECT serving_version FROM kappa.freshness WHERE view = '{VIEW}'"


def _sql_token(cluster: Cluster) -> str:
    import base64

    secret = cluster.get("secret", "kappa-sql", "-n", NS)
    return base64.b64decode(secret["data"]["token"]).decode()


def _analyst(operator: Operator, block: Block, cluster: Cluster, name: str, *, serving: int) -> str:
    """The analyst's SQL block, verbatim: beeline's kappa.freshness says ``serving`` for the replayed view (the service
    follows promotions and rollbacks by itself: the same pod every time, never restarted), and the Spark Connect
    client's query printed rows. Returns the pod's name and uid."""
    out = operator.run(block, name, timeout=900)
    found = re.search(rf"^\|\s*{VIEW}\s*\|\s*(\d+)\s*\|", out, re.M)
    assert found and int(found.group(1)) == serving, \
        f"kappa.freshness over JDBC, {VIEW} serving v{serving}:\n{out[-3000:]}"
    assert re.search(r"^\|\s*campaign_id\s*\|\s*sum\(view_count\)\s*\|", out, re.M), f"Spark Connect:\n{out[-3000:]}"
    pods = [p for p in cluster.pods() if p["metadata"]["labels"].get("app.kubernetes.io/name") == "kappa-sql"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    restarts = [c["restartCount"] for c in pods[0]["status"].get("containerStatuses", [])]
    assert restarts == [0], f"the SQL service restarted: {restarts}"
    return f"{pods[0]['metadata']['name']}/{pods[0]['metadata']['uid']}"


def test_deploy_md_section_5_verbatim_on_a_fresh_node() -> None:
    capable = node_sh("check", timeout=60)
    if capable.returncode != 0:
        pytest.fail((capable.stderr.strip().splitlines() or ["infra/k8s/node.sh check failed"])[-1], pytrace=False)
    blocks = {name: cluster_block(text) for name, text in (
        ("install", "helm install"), ("query", "bin/kappa query"), ("sql", "svc/kappa-sql"),
        ("replay", "kappa_replay"), ("upgrade", "helm upgrade"), ("rollback", "kappa_rollback"),
        ("clean-up", "helm uninstall"))}
    assert [b.where for b in cluster_blocks()] == [b.where for b in blocks.values()], \
        "docs/deploy.md's cluster blocks are these seven, in this order"
    assert "watch_minutes" not in blocks["replay"].text and '"auto_promote": true' in blocks["replay"].text
    if (HOME / "etcd").exists():  # an earlier cluster of this checkout: a fresh one, its images kept
        reset = node_sh("reset", timeout=900)
        assert reset.returncode == 0, reset.stderr[-2000:]

    operator, started, sampler = Operator(), time.monotonic(), None
    cluster: Cluster | None = None
    session: Client | None = None
    extra: dict[str, Any] = {}
    cleaned = False
    try:
        # 1. install
        operator.run(blocks["install"], "install", timeout=3600, first=True)
        cluster = Cluster()
        sampler = MemorySampler(cluster, operator)
        sampler.start()
        cluster.wait_all_ready(120)
        names = {p["metadata"]["labels"].get("app.kubernetes.io/name") for p in cluster.pods()}
        for expected in ("kappa-kafka", "kappa-views", "kappa-producer", "kappa-postgresql",
                         "kappa-airflow-api-server", "kappa-airflow-scheduler", "kappa-airflow-dag-processor",
                         "kappa-airflow-triggerer", "kappa-sql"):
            assert expected in names, f"{expected} not running: {sorted(n for n in names if n)}"

        # 2. rows in every view, then the analyst's block
        lake = cluster.lake()
        t = time.monotonic()
        counts: dict[str, int] = {}

        def every_view_has_rows() -> bool:
            nonlocal counts
            counts = _rows(lake)
            return all(counts.values())

        _wait(f"rows in every view ({counts})", every_view_has_rows, timeout=900, every=10)
        operator.timings["install -> rows in every view"] = round(time.monotonic() - started, 1)
        operator.timings["rows after the install"] = round(time.monotonic() - t, 1)
        print(f"[smoke] rows per view: {counts}")
        out = operator.run(blocks["query"], "query", timeout=600)
        assert f"{VIEW}: serving v1" in out and out.count("│") > 10, out[-2000:]
        sql_pod = _analyst(operator, blocks["sql"], cluster, "sql", serving=1)
        # one JDBC session through the block's port-forward, kept open across the promote and the rollback
        session = Client(ROOT / ".cache" / "analyst-venv" / "bin" / "python", "jdbc", 10000, _sql_token(cluster))
        assert session.opened == {"ready": True}, session.opened
        assert session.rows(SERVING_SQL) == [[1]]
        refused = session.ask(sql=f"INSERT INTO analytics.{VIEW} SELECT * FROM analytics.{VIEW} LIMIT 1")
        assert "kappa sql is read-only" in refused.get("error", ""), refused
        extra["sql_refused_insert"] = refused["error"][:300]

        # 3. the replay, promoted, watched for the default window, still serving
        t = time.monotonic()
        out = operator.run(blocks["replay"], "replay", timeout=3600)
        final = [line for line in out.splitlines() if line.startswith(("success", "failed"))]
        assert final and final[-1].startswith("success"), out[-3000:]
        assert re.search(r"\bpromote success\b", final[-1]) and re.search(r"\bwatch success\b", final[-1]), final[-1]
        assert time.monotonic() - t >= WATCH_MINUTES * 60, "the run ended before its watch window did"
        assert _serving(lake, VIEW) == 2, "v2 serves after the watch window"
        v2 = cluster.get("deployment", "kappa-view-campaign-window-counts-v2", "-n", NS)
        assert v2["status"].get("readyReplicas") == 1, v2["status"]
        extra["replay_output_tail"] = out.splitlines()[-6:]
        assert _analyst(operator, blocks["sql"], cluster, "sql after the promote", serving=2) == sql_pod
        assert session.rows(SERVING_SQL) == [[2]], "the session opened before the replay reads the promoted version"

        # 4. upgrade after the promote, rollback, upgrade after it
        out = operator.run(blocks["upgrade"], "upgrade after the promote", timeout=1800)
        assert _record(cluster) == {"1": "stopped", "2": "running"}, out[-1000:]
        assert f"{VIEW}@v1" not in _hosted(cluster)
        cluster.wait_all_ready(300)
        out = operator.run(blocks["rollback"], "rollback", timeout=1800)
        assert _serving(lake, VIEW) == 1, out[-2000:]
        cluster.kubectl("wait", "--for=delete", "deployment/kappa-view-campaign-window-counts-v2", "-n", NS,
                        "--timeout=300s", timeout=330)
        t = time.monotonic()
        cluster.wait_all_ready(600)  # v1's own driver Ready, the grouped driver too: every pod
        operator.timings["rollback -> every pod Ready"] = round(time.monotonic() - t, 1)
        assert _analyst(operator, blocks["sql"], cluster, "sql after the rollback", serving=1) == sql_pod
        assert session.rows(SERVING_SQL) == [[1]], "the same session follows the rollback"
        out = operator.run(blocks["upgrade"], "upgrade after the rollback", timeout=1800)
        assert _record(cluster) == {"1": "running", "2": "stopped"}, out[-1000:]
        v1 = cluster.get("deployment", "kappa-view-campaign-window-counts-v1", "-n", NS)
        assert v1["status"].get("readyReplicas") == 1, v1["status"]
        restarts = {f"{p['metadata']['name']}/{c['name']}": c["restartCount"] for p in cluster.pods()
                    for c in p["status"].get("containerStatuses", []) if c["restartCount"]}
        extra["container_restarts"] = restarts
        print(f"[smoke] container restarts: {restarts or 'none'}")
        sampler.stopping.set()

        # 5. the documented clean-up, then nothing of the node is left
        operator.run(blocks["clean-up"], "clean-up", timeout=1200)
        cleaned = True
        operator.stop_all()
        left = node_sh("leftovers", timeout=120)
        assert left.returncode == 0 and not left.stdout.strip(), f"left on the machine after make cluster-down:\n{left.stdout}"
        _report(operator, sampler, time.monotonic() - started, "passed", extra)
        print(f"[smoke] passed in {time.monotonic() - started:.0f} s: {operator.timings}")
        print(f"[smoke] memory a minute after the install (MiB): {_mib(sampler.after_install)}")
        print(f"[smoke] memory peak (MiB): {_mib(sampler.peak)}")
        print(f"[smoke] the grouped driver's peak: {sampler.peak_at.get('kappa-views')}")
    except BaseException:
        if sampler:
            sampler.stopping.set()
        if cluster is not None and not cleaned:
            try:
                print(cluster.diagnostics())
            except Exception as exc:  # noqa: BLE001
                print(f"[smoke] no diagnostics: {exc}")
        _report(operator, sampler, time.monotonic() - started, "failed", extra)
        raise
    finally:
        if session is not None:
            session.close()
        operator.stop_all()
        if not cleaned and os.environ.get("KAPPA_SMOKE_KEEP") != "1":
            node_sh("down", timeout=600)  # the rest of make test gets the machine back
