"""The images `make images` builds (infra/images/build.sh) run as the chart runs them: podman with Debian's runc,
the chart's user, a read-only root filesystem, every capability dropped, and only the chart's volumes writable
(emptyDirs as tmpfs, PVCs as host folders owned like an fsGroup volume).

- view-job (10001): the default command (`kappa --help`), Java 17, a local Spark session that must map the image's
  class-data sharing archive (-Xshare:on) writing and reading a Delta table; with the platform's object store (host
  network): `kappa lake check` and a Delta table written and read over s3a, read back by delta-rs on the host;
- airflow (50000:0): `airflow version` through the entrypoint (both `airflow version` and the bare `version`),
  the runner's imports (kappa, kubernetes, psycopg2), Java, the DAGs import without errors, the user/umask the
  entrypoint sets, an arbitrary uid of group 0;
- kafka (10001): the chart's own start.sh and server.properties (rendered with the pinned helm) format the data
  volume and start a KRaft broker; a record produced and consumed with the image's tools; restarted on the same
  volume (no re-format) the record is still there; every tool script starts its class;
- postgres (10001): the chart's env (POSTGRES_USER, POSTGRES_DB, POSTGRES_PASSWORD_FILE, PGDATA) initialises the
  volume once, the chart's pg_isready probe passes, the password logs in over TCP (a wrong one does not), and a
  restart on the same volume keeps the data without initialising again;
- every image saves as a docker-archive (what a node imports with `ctr images import`).

Marker ``cluster`` (`make test-cluster`, which builds the images first): an image that is missing is a failure.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
import deploy_helpers as h  # noqa: E402

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
RUNC = "/usr/sbin/runc"
PINS = h.versions()


def _ulimits() -> list[str]:
    """The machine's hard limits (runc cannot set more; nproc above pid_max fails on this kind of VM)."""
    import resource

    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else nofile
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


#: the chart's containerSecurityContext: read-only root, no capabilities, no privilege escalation; and, as under
#: Kubernetes, no passwd entry made up for a uid the image does not know (podman adds one by default)
RESTRICTED = ["--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
              "--passwd=false"]


def _tmpfs(path: str, size: str = "1g") -> list[str]:
    # an emptyDir: writable by any uid, exec allowed (JNI libraries unpack into /tmp)
    return ["--tmpfs", f"{path}:rw,exec,mode=1777,size={size}"]


def podman(*args: str, check: bool = True, timeout: float = 600, stdin: str | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, input=stdin)
    if check and res.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def run(image: str, *cmd: str, user: str, opts: tuple[str, ...] = (), check: bool = True,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """``podman run --rm`` as the chart runs the image (no network unless ``opts`` asks for one)."""
    return podman("run", "--rm", "--runtime", RUNC, *_ulimits(), *RESTRICTED, "--user", user,
                  *(opts if "--network" in " ".join(opts) else ("--network", "none", *opts)), image, *cmd,
                  check=check, timeout=timeout)


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run `make images` (it installs podman from Debian and builds the images)")
    listed = subprocess.run(["bash", str(ROOT / "infra" / "images" / "build.sh"), "list"], capture_output=True,
                            text=True, check=True).stdout.split()
    found = {}
    for image in listed:
        repo = image.rsplit(":", 1)[0].rsplit("/", 1)[1]
        assert podman("image", "exists", image, check=False).returncode == 0, f"{image} is missing: run `make images`"
        found[repo] = image
    assert set(found) == {"view-job", "airflow", "kafka", "postgres"}, listed
    return found


@pytest.fixture(scope="module")
def chart() -> list[dict]:
    """The chart rendered with its defaults (the pinned helm, as tests/deploy)."""
    return h.render()


def _container(objs: list[dict], kind: str, name: str) -> dict:
    return h.pod_spec(h.named(objs, kind, name))["containers"][0]


def _env_values(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _volume_dir(tmp_path: Path, name: str, uid: int = 10001, gid: int = 10001) -> Path:
    """A host folder as a PVC with fsGroup ``gid`` mounts it: owned root:gid, setgid, group-writable."""
    d = tmp_path / name
    d.mkdir()
    os.chown(d, 0, gid)
    d.chmod(0o2775)
    return d


@pytest.fixture
def container_name() -> Iterator[str]:
    names: list[str] = []

    def make(prefix: str) -> str:
        names.append(f"kappa-test-{prefix}-{uuid.uuid4().hex[:8]}")
        return names[-1]

    yield make  # type: ignore[misc]
    for name in names:
        podman("rm", "-f", "-t", "5", name, check=False, timeout=120)


def _wait_for_log(name: str, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    logs = ""
    while time.monotonic() < deadline:
        logs = podman("logs", name, check=False).stdout + podman("logs", name, check=False).stderr
        if text in logs:
            return logs
        state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()
        if state in ("exited", "stopped", ""):
            raise AssertionError(f"{name} exited before logging {text!r}:\n{logs[-5000:]}")
        time.sleep(1)
    raise AssertionError(f"{name} did not log {text!r} within {timeout:.0f}s:\n{logs[-5000:]}")


# ------------------------------------------------------------------------------------------ save
def test_every_image_saves_as_a_docker_archive(images: dict[str, str], tmp_path: Path) -> None:
    for image in images.values():
        archive = tmp_path / "image.tar"
        podman("save", "--format", "docker-archive", "-o", str(archive), image, timeout=900)
        with tarfile.open(archive) as tar:
            manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert manifest[0]["RepoTags"] == [image], manifest[0]["RepoTags"]
        assert manifest[0]["Layers"], image
        archive.unlink()


# ------------------------------------------------------------------------------------------ view-job
SPARK_DELTA = """
import sys
from kappa.config import Settings
from kappa.runtime.cds import archive_path
from kappa.runtime.spark import build_spark
settings = Settings.from_env().replace(home="/tmp/kappa")
archive = archive_path(settings.jars_dir)
assert archive.is_file(), archive
# -Xshare:on: a JVM that cannot map the archive does not start
spark = build_spark("image-test", settings, master="local[1]",
                    cds_options=["-XX:SharedArchiveFile=" + str(archive), "-Xshare:on"])
spark.range(7).write.format("delta").save("/tmp/lake/t")
print("rows", spark.read.format("delta").load("/tmp/lake/t").count())
print("jars", len(spark.sparkContext.getConf().get("spark.jars").split(",")))
spark.stop()
"""


def test_view_job_image_runs_kappa_java_and_spark_with_delta_as_10001(images: dict[str, str]) -> None:
    image, user, tmp = images["view-job"], "10001:10001", _tmpfs("/tmp")
    res = run(image, user=user, opts=tuple(tmp))  # the default command
    assert "Usage" in res.stdout and "kappa" in res.stdout, res.stdout
    res = run(image, "java", "-version", user=user, opts=tuple(tmp))
    assert 'version "17.' in res.stderr, res.stderr
    res = run(image, "id", "-u", user=user, opts=tuple(tmp))
    assert res.stdout.strip() == "10001"
    res = run(image, "python", "-c", SPARK_DELTA, user=user, opts=tuple(tmp), timeout=600)
    assert "rows 7" in res.stdout, res.stdout + res.stderr[-3000:]
    jars = int(res.stdout.split("jars", 1)[1].split()[0])
    assert jars >= 5, res.stdout  # spark-sql-kafka, kafka-clients, delta-spark, delta-storage, hadoop-aws, ...


SPARK_S3 = """
from kappa.config import Settings
from kappa.runtime.spark import build_spark
settings = Settings.from_env()
spark = build_spark("image-s3-test", settings, master="local[1]")
path = settings.lake_uri + "/image-check"
spark.range(5).write.format("delta").save(path)
print("rows", spark.read.format("delta").load(path).count())
spark.stop()
"""


def test_view_job_image_reaches_a_lake_on_the_object_store(images: dict[str, str], object_store) -> None:
    """The image's S3A jars (hadoop-aws with the AWS SDK modules, no bundle) against the platform's real store, with
    the variables the chart sets: `kappa lake check` answers, and a Spark session writes and reads a Delta table
    there, which delta-rs on the host then reads back."""
    from deltalake import DeltaTable

    from kappa.runtime.deltars import read_rows, rs_uri

    lake = f"s3a://kappa/image-{uuid.uuid4().hex[:8]}"
    env = {**object_store.delta_rs_options(), "KAPPA_LAKE_URI": lake, "KAPPA_HOME": "/tmp/kappa", "HOME": "/tmp"}
    opts = (*_tmpfs("/tmp"), "--network", "host", *[f"--env={k}={v}" for k, v in env.items()])
    image, user = images["view-job"], "10001:10001"
    res = run(image, "kappa", "lake", "check", user=user, opts=opts)
    assert f"the store at {object_store.endpoint} lists it" in res.stdout, res.stdout + res.stderr
    res = run(image, "python", "-c", SPARK_S3, user=user, opts=opts, timeout=600)
    assert "rows 5" in res.stdout, res.stdout + res.stderr[-3000:]
    rows = read_rows(DeltaTable(rs_uri(f"{lake}/image-check"), storage_options=object_store.delta_rs_options()))
    assert sorted(r["id"] for r in rows) == list(range(5))


# ------------------------------------------------------------------------------------------ airflow
def _airflow_opts() -> tuple[str, ...]:
    # the chart's Airflow env (the parts that matter without a database) and its emptyDirs
    env = {"AIRFLOW_HOME": "/opt/airflow", "AIRFLOW__CORE__DAGS_FOLDER": "/opt/kappa/dags",
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "XDG_CACHE_HOME": "/tmp/.cache", "XDG_CONFIG_HOME": "/tmp/.config",
           "MPLCONFIGDIR": "/tmp/.matplotlib"}
    opts = [*_tmpfs("/tmp"), *_tmpfs("/opt/airflow")]
    for key, value in env.items():
        opts += ["--env", f"{key}={value}"]
    return tuple(opts)


DAGBAG = """
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder="/opt/kappa/dags")
assert not bag.import_errors, bag.import_errors
print("dags", " ".join(sorted(bag.dag_ids)))
"""


def test_airflow_image_runs_airflow_the_runner_imports_and_the_dags_as_50000(images: dict[str, str]) -> None:
    image, user, opts = images["airflow"], "50000:0", _airflow_opts()
    # the chart's args go through the entrypoint, which first waits for `airflow db check` (SQLite here)
    for cmd in (("airflow", "version"), ("version",)):
        res = run(image, *cmd, user=user, opts=opts)
        assert res.stdout.strip().splitlines()[-1] == PINS["AIRFLOW_VERSION"], res.stdout + res.stderr
    res = run(image, "python", "-c", "import kappa, kubernetes, psycopg2, kappa.control.runners.kubernetes; "
              "import airflow.providers.cncf.kubernetes, airflow.providers.postgres; print('imports ok')",
              user=user, opts=opts)
    assert "imports ok" in res.stdout, res.stderr
    res = run(image, "bash", "-c", "id -u; id -g; echo $HOME; umask; java -version 2>&1 | head -1; "
              "echo $KAPPA_REPO_ROOT; ls /opt/kappa/.cache/jars/spark | wc -l", user=user, opts=opts)
    uid, gid, home, umask, java, repo, njars = res.stdout.strip().splitlines()
    assert (uid, gid, home, umask, repo) == ("50000", "0", "/home/airflow", "0002", "/opt/kappa"), res.stdout
    assert 'version "17.' in java and int(njars) >= 5, res.stdout
    res = run(image, "python", "-c", DAGBAG, user=user, opts=opts, timeout=300)
    assert res.stdout.strip().splitlines()[-1] == "dags kappa_replay kappa_retire kappa_rollback", res.stdout + res.stderr
    # OpenShift-style arbitrary uid of group 0, as the official image supports it: a passwd entry appended to the
    # group-writable /etc/passwd (so not with a read-only root: Airflow refuses a uid without a user name)
    res = podman("run", "--rm", "--runtime", RUNC, *_ulimits(), "--passwd=false", "--user", "12345:0",
                 "--network", "none", image, "airflow", "version")
    assert res.stdout.strip().splitlines()[-1] == PINS["AIRFLOW_VERSION"], res.stdout + res.stderr


# ------------------------------------------------------------------------------------------ kafka
def test_kafka_image_runs_the_charts_broker_as_10001(images: dict[str, str], chart: list[dict], tmp_path: Path,
                                                     container_name) -> None:
    image = images["kafka"]
    spec = _container(chart, "StatefulSet", "kappa-kafka")
    assert spec["image"] == f"docker.io/apache/kafka:{PINS['KAFKA_IMAGE_TAG']}", "the chart default this image stands in for"
    config = tmp_path / "config"
    config.mkdir()
    for key, text in h.configmap_data(chart, "kappa-kafka").items():
        (config / key).write_text(text)
    data = _volume_dir(tmp_path, "data")
    env = {**_env_values(spec), "POD_NAME": "kappa-kafka-0", "POD_NAMESPACE": "kappa",
           "KAFKA_CLUSTER_ID": base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=").replace("-", "A")}
    host = "kappa-kafka-0.kappa-kafka-headless.kappa.svc.cluster.local"  # advertised + controller quorum address
    opts = ["--runtime", RUNC, *_ulimits(), *RESTRICTED, "--user", "10001:10001", "--add-host", f"{host}:127.0.0.1",
            "-v", f"{data}:/var/lib/kafka/data", "-v", f"{config}:/etc/kappa-kafka:ro", *_tmpfs("/tmp")]
    for key, value in env.items():
        opts += ["--env", f"{key}={value}"]
    command = spec["command"]
    assert command[0] == "/bin/bash"

    def start() -> str:
        name = container_name("kafka")
        podman("run", "-d", "--name", name, *opts, "--entrypoint", command[0], image, *command[1:])
        _wait_for_log(name, "Kafka Server started", timeout=180)
        return name

    def tool(name: str, *args: str, stdin: str | None = None) -> str:
        return podman("exec", "-i", name, *args, stdin=stdin, timeout=180).stdout

    broker = start()
    assert (data / "logs" / "meta.properties").is_file(), "start.sh formats log.dirs on the data volume"
    tool(broker, "kafka-topics.sh", "--bootstrap-server", "localhost:9092", "--create", "--topic", "image-test",
         "--partitions", "1", "--replication-factor", "1")
    tool(broker, "kafka-console-producer.sh", "--bootstrap-server", "localhost:9092", "--topic", "image-test",
         stdin="hello-kappa\n")
    consume = ("kafka-console-consumer.sh", "--bootstrap-server", "localhost:9092", "--topic", "image-test",
               "--from-beginning", "--max-messages", "1", "--timeout-ms", "60000")
    assert tool(broker, *consume).strip() == "hello-kappa"
    # every tool script starts its class (usage or version, no missing class)
    scripts = tool(broker, "bash", "-c", "ls /opt/kafka/bin").split()
    for script in scripts:
        if script in ("kafka-run-class.sh", "kafka-server-start.sh", "kafka-server-stop.sh"):
            continue
        res = podman("exec", broker, script, "--help", check=False, timeout=120)
        out = res.stdout + res.stderr
        assert "ClassNotFoundException" not in out and "Could not find or load main class" not in out, (script, out)
    # GC log and console output under LOG_DIR (an emptyDir), nothing written to the read-only root
    assert "kafkaServer-gc.log" in tool(broker, "ls", env["LOG_DIR"])
    # controlled shutdown, then the same volume again: formatted once, the record kept
    podman("stop", "-t", "90", broker, timeout=150)
    logs = podman("logs", broker).stdout
    assert "shut down completed" in logs or "Kafka Server shut down" in logs or "shutting down" in logs.lower(), logs[-3000:]
    broker = start()
    logs = podman("logs", broker).stdout + podman("logs", broker).stderr
    assert "already formatted" in logs, logs[-3000:]
    assert tool(broker, *consume).strip() == "hello-kappa"


# ------------------------------------------------------------------------------------------ postgres
def test_postgres_image_initialises_once_and_takes_password_logins_as_10001(images: dict[str, str], chart: list[dict],
                                                                           tmp_path: Path, container_name) -> None:
    image = images["postgres"]
    spec = _container(chart, "StatefulSet", "kappa-postgresql")
    assert spec["image"] == f"docker.io/postgres:{PINS['POSTGRES_IMAGE_TAG']}", "the chart default this image stands in for"
    env = _env_values(spec)
    user, database = env["POSTGRES_USER"], env["POSTGRES_DB"]
    password = uuid.uuid4().hex
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "password").write_text(password)
    os.chown(secret / "password", 0, 10001)
    (secret / "password").chmod(0o440)  # the chart's defaultMode, readable through the fsGroup
    data = _volume_dir(tmp_path, "data")
    mounts = {m["name"]: m["mountPath"] for m in spec["volumeMounts"]}
    opts = ["--runtime", RUNC, *_ulimits(), *RESTRICTED, "--user", "10001:10001",
            "-v", f"{data}:{mounts['data']}", "-v", f"{secret}:{mounts['password']}:ro",
            *_tmpfs(mounts["run"], "64m"), *_tmpfs(mounts["tmp"], "256m")]
    for key, value in env.items():
        opts += ["--env", f"{key}={value}"]
    probe = spec["readinessProbe"]["exec"]["command"]
    assert probe[0] == "pg_isready"

    def start() -> str:
        name = container_name("postgres")
        podman("run", "-d", "--name", name, *opts, image)
        deadline = time.monotonic() + 120
        while podman("exec", name, *probe, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{' '.join(probe)} never passed:\n{podman('logs', name, check=False).stderr[-4000:]}")
            time.sleep(1)
        return name

    def login(name: str, pw: str) -> subprocess.CompletedProcess:
        # over TCP to the pod's own address: the pg_hba line for remote hosts (scram-sha-256), not loopback trust
        ip = podman("inspect", "--format", "{{.NetworkSettings.IPAddress}}", name).stdout.strip()
        assert ip, "the container has an address on podman's network"
        return podman("exec", "--env", f"PGPASSWORD={pw}", name, "psql", "-h", ip, "-U", user, "-d", database,
                      "-tAc", "SELECT current_user || '|' || current_database() || '|' || current_setting('server_version')",
                      check=False)

    pg = start()
    first = podman("logs", pg).stdout + podman("logs", pg).stderr
    assert "PostgreSQL init process complete" in first, first[-3000:]
    assert (data / "pgdata" / "PG_VERSION").read_text().strip() == PINS["POSTGRES_MAJOR"]
    ok = login(pg, password)
    assert ok.returncode == 0, ok.stderr
    who, db, version = ok.stdout.strip().split("|")
    assert (who, db) == (user, database) and version.startswith(PINS["POSTGRES_MAJOR"] + ".")
    encoding = podman("exec", "--env", f"PGPASSWORD={password}", pg, "psql", "-h", "127.0.0.1", "-U", user, "-d",
                      database, "-tAc", "SHOW server_encoding").stdout.strip()
    assert encoding == "UTF8", "initdb under the image's LANG=C.UTF-8, as the official image's en_US.utf8"
    bad = login(pg, "wrong")
    assert bad.returncode != 0 and "password authentication failed" in bad.stderr, bad.stdout + bad.stderr
    assert podman("exec", "--env", f"PGPASSWORD={password}", pg, "psql", "-h", "127.0.0.1", "-U", user, "-d", database,
                  "-c", "CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)").returncode == 0
    podman("stop", "-t", "30", pg, timeout=90)
    pg = start()
    second = podman("logs", pg).stdout + podman("logs", pg).stderr
    assert "init process complete" not in second, "an initialised volume must not be initialised again"
    res = podman("exec", "--env", f"PGPASSWORD={password}", pg, "psql", "-h", "127.0.0.1", "-U", user, "-d", database,
                 "-tAc", "SELECT x FROM kept")
    assert res.stdout.strip() == "42"
