"""infra/images: Dockerfile build-arg pins == infra/versions.env, sources exist, non-root, entrypoint."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

import deploy_helpers as h

pytestmark = pytest.mark.deploy

IMAGES = h.ROOT / "infra" / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def arg_defaults(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for ins, rest in instructions(path):
        if ins == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            found.setdefault(name.strip(), []).append(value.strip().strip('"'))
    return found


def test_dockerfiles_exist() -> None:
    assert {p.name for p in DOCKERFILES} == {"view-job.Dockerfile", "airflow.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_arg_defaults_equal_versions_env(dockerfile: Path) -> None:
    pins = h.versions()
    args = arg_defaults(dockerfile)
    assert args, "pinned build ARGs expected"
    for name, defaults in args.items():
        assert name in pins, f"{dockerfile.name}: ARG {name} has no pin in infra/versions.env"
        assert set(defaults) == {pins[name]}, f"{dockerfile.name}: ARG {name}={defaults} but versions.env has {pins[name]}"
    required = {"view-job.Dockerfile": {"PYTHON_VERSION", "SPARK_VERSION", "DELTA_VERSION", "DELTA_SPARK_ARTIFACT",
                                        "KAFKA_VERSION", "SCALA_BINARY", "DEBIAN_RELEASE", "MAVEN_IMAGE_TAG"},
                "airflow.Dockerfile": {"AIRFLOW_VERSION", "PYTHON_VERSION"}}[dockerfile.name]
    assert required <= set(args), f"{dockerfile.name}: missing pinned ARGs {sorted(required - set(args))}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_args(dockerfile: Path) -> None:
    froms = [rest.split()[0] for ins, rest in instructions(dockerfile) if ins == "FROM"]
    assert froms
    stages = {rest.split()[-1] for ins, rest in instructions(dockerfile) if ins == "FROM" and " AS " in rest.upper()}
    for ref in froms:
        if ref in stages:
            continue
        assert ":" in ref and "latest" not in ref, f"{dockerfile.name}: FROM {ref}"
        assert "${" in ref, f"{dockerfile.name}: FROM {ref} does not take its tag from a pinned ARG"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist(dockerfile: Path) -> None:
    for ins, rest in instructions(dockerfile):
        if ins not in ("COPY", "ADD"):
            continue
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        if "--from=" in rest:
            continue
        for src in parts[:-1]:
            assert (h.ROOT / src).exists(), f"{dockerfile.name}: COPY source {src} does not exist"


@pytest.mark.parametrize(("dockerfile", "uid"), [("view-job.Dockerfile", 10001), ("airflow.Dockerfile", 50000)])
def test_images_run_as_the_chart_uid(dockerfile: str, uid: int, default_objs: list[dict]) -> None:
    users = [rest for ins, rest in instructions(IMAGES / dockerfile) if ins == "USER"]
    final = users[-1].split(":")[0]
    assert final.isdigit() and int(final) == uid, f"{dockerfile}: final USER {users[-1]} (numeric non-root expected)"
    image_repo = {"view-job.Dockerfile": "kappa/view-job", "airflow.Dockerfile": "kappa/airflow"}[dockerfile]
    pods = [w for w in h.workloads(default_objs) if h.pod_spec(w)["containers"][0]["image"].startswith(image_repo)]
    assert pods
    for w in pods:
        assert h.pod_spec(w)["securityContext"]["runAsUser"] == uid, w["metadata"]["name"]


def _unset_properties(pom: Path) -> set[str]:
    return set(re.findall(r"<([A-Za-z0-9.]+)>UNSET</\1>", pom.read_text()))


def test_every_maven_property_is_passed_pinned() -> None:
    text = (IMAGES / "view-job.Dockerfile").read_text()
    passed = set(re.findall(r"-D([A-Za-z0-9.]+)=", text))
    for pom in (h.ROOT / "infra" / "local" / "pom.xml", IMAGES / "s3a.pom.xml"):
        missing = _unset_properties(pom) - passed
        assert not missing, f"{pom.name}: properties {sorted(missing)} are not passed by view-job.Dockerfile"
    assert not any("spark.jars.packages" in rest for _, rest in instructions(IMAGES / "view-job.Dockerfile"))


def test_view_job_layout_matches_the_chart(default_objs: list[dict]) -> None:
    text = (IMAGES / "view-job.Dockerfile").read_text()
    # the topics Job mounts the declarations where the editable install reads them
    job = h.named(default_objs, "Job", "kappa-topics")
    mount = next(m for m in h.pod_spec(job)["containers"][0]["volumeMounts"] if m["name"] == "platform")
    assert mount["mountPath"] == "/opt/kappa/kappa/platform.yaml"
    assert "pip install --no-deps -e /opt/kappa" in text and "WORKDIR /opt/kappa" in text
    assert "COPY --from=jars /jars/ .cache/jars/spark/" in text  # kappa.runtime.spark.spark_jars(<repo>/.cache/jars)
    # the chart points SPARK_CONF_DIR at its ConfigMap and the executor template uses the image's entrypoint
    driver = h.view_deployments(default_objs)[0]
    env = {e["name"]: e.get("value") for e in h.pod_spec(driver)["containers"][0]["env"]}
    assert env["SPARK_CONF_DIR"] == "/opt/kappa/spark-conf"
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "/opt/kappa/bin/entrypoint.sh"]' in text
    assert "command" not in h.pod_spec(driver)["containers"][0], "the driver must keep the image entrypoint"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_keeps_caches_out(dockerfile: Path) -> None:
    ignore = Path(f"{dockerfile}.dockerignore").read_text().split()
    assert {".git", ".cache", ".kappa"} <= set(ignore)


def test_chart_image_defaults_follow_versions_env() -> None:
    pins = h.versions()
    values = yaml.safe_load((h.CHART / "values.yaml").read_text())
    assert values["kafka"]["image"]["tag"] == pins["KAFKA_IMAGE_TAG"] == pins["KAFKA_VERSION"]
    assert values["kafka"]["image"]["repository"] == "apache/kafka"
    assert values["airflow"]["postgresql"]["image"]["tag"] == pins["POSTGRES_IMAGE_TAG"]
    chart = yaml.safe_load((h.CHART / "Chart.yaml").read_text())
    ann = chart["annotations"]
    assert ann["kappa.io/kafka-version"] == pins["KAFKA_VERSION"]
    assert ann["kappa.io/spark-version"] == pins["SPARK_VERSION"]
    assert ann["kappa.io/airflow-version"] == pins["AIRFLOW_VERSION"]
    project = re.search(r'^version = "([^"]+)"', (h.ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == project, "images are tagged with the project version (the chart appVersion)"
    assert pins["KAPPA_VERSION"] == project, "the Airflow image copies the jars of the view-job image of this tag"


# ------------------------------------------------------------------------------------------ entrypoint
def _fake_java(tmp_path: Path) -> Path:
    java_home = tmp_path / "jdk"
    (java_home / "bin").mkdir(parents=True)
    java = java_home / "bin" / "java"
    java.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    return java_home


def test_entrypoint_starts_spark_executors(tmp_path: Path) -> None:
    env = {
        "PATH": os.environ["PATH"], "JAVA_HOME": str(_fake_java(tmp_path)), "SPARK_HOME": "/opt/spark",
        "SPARK_JAVA_OPT_10": "-Dten=1", "SPARK_JAVA_OPT_2": "-Dtwo=1", "SPARK_JAVA_OPT_0": "-Dzero=1",
        "SPARK_EXECUTOR_MEMORY": "1g", "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@d:7078",
        "SPARK_EXECUTOR_ID": "3", "SPARK_EXECUTOR_CORES": "2", "SPARK_APPLICATION_ID": "spark-app",
        "SPARK_EXECUTOR_POD_IP": "10.0.0.9", "SPARK_RESOURCE_PROFILE_ID": "0", "SPARK_EXECUTOR_POD_NAME": "x-exec-3",
        "SPARK_CONF_DIR": "/opt/kappa/spark-conf",
    }
    res = subprocess.run(["bash", str(IMAGES / "spark-entrypoint.sh"), "executor"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    args = res.stdout.splitlines()
    assert args[:3] == ["-Dzero=1", "-Dtwo=1", "-Dten=1"], "SPARK_JAVA_OPT_n in numeric order"
    assert args[3:5] == ["-Xms1g", "-Xmx1g"]
    assert args[args.index("-cp") + 1] == "/opt/kappa/spark-conf:/opt/spark/jars/*"
    assert "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend" in args
    for flag, value in (("--driver-url", "spark://CoarseGrainedScheduler@d:7078"), ("--executor-id", "3"),
                        ("--cores", "2"), ("--hostname", "10.0.0.9"), ("--podName", "x-exec-3")):
        assert args[args.index(flag) + 1] == value


def test_entrypoint_passes_other_commands_through() -> None:
    res = subprocess.run(["bash", str(IMAGES / "spark-entrypoint.sh"), "printf", "%s|", "kappa", "view run"],
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout == "kappa|view run|"
    # files on the shared lake volume stay group-writable (fsGroup 10001 is shared with Airflow)
    res = subprocess.run(["bash", str(IMAGES / "spark-entrypoint.sh"), "bash", "-c", "umask"], capture_output=True, text=True)
    assert res.stdout.strip() == "0002"


# ------------------------------------------------------------------------------------------ BuildKit checks
def test_dockerfiles_pass_buildkit_checks(helm: Path) -> None:
    lint = h.TOOLS / "dockerfile-lint"
    if not lint.exists():
        subprocess.run(["bash", str(h.ROOT / "infra" / "verify-offline.sh"), "--tools"], check=True, cwd=h.ROOT,
                       capture_output=True)
    res = subprocess.run([str(lint), *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    bad = tmp = h.ROOT / ".cache" / "deploy-verify-bad.Dockerfile"
    try:
        tmp.write_text("FROM alpine:3.20 AS a\nfrom alpine:3.20 as b\nCMD echo hi\n")
        res = subprocess.run([str(lint), str(bad)], capture_output=True, text=True)
        assert res.returncode == 1 and "JSONArgsRecommended" in res.stdout, "the linter must catch problems"
    finally:
        tmp.unlink(missing_ok=True)
