"""infra/images: Dockerfile build-arg pins == infra/versions.env, sources exist, non-root, entrypoints.

The project's Dockerfiles (view-job, airflow) and the local stand-ins for official images that
infra/images/build.sh (`make images`) builds where no registry is reachable (infra/images/bases/): every base image
is a build arg defaulting to the official image (tags from pinned args), and build.sh passes a local one for each.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

import deploy_helpers as h

pytestmark = pytest.mark.deploy

IMAGES = h.ROOT / "infra" / "images"
BASES = IMAGES / "bases"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile")) + sorted(BASES.glob("*.Dockerfile"))
BUILD_SH = IMAGES / "build.sh"

#: what each base-image build arg stands for where a registry is reachable: the official image (from the pins)
OFFICIAL_IMAGES = {
    "PYTHON_IMAGE": ["python:{PYTHON_VERSION}-slim-{DEBIAN_RELEASE}"],
    "MAVEN_IMAGE": ["maven:{MAVEN_IMAGE_TAG}"],
    "AIRFLOW_IMAGE": ["apache/airflow:{AIRFLOW_VERSION}-python{PYTHON_VERSION}"],
    "VIEW_JOB_IMAGE": ["kappa/view-job:{KAPPA_VERSION}"],
    "DEBIAN_IMAGE": ["debian:{DEBIAN_RELEASE}-slim", "debian:{POSTGRES_DEBIAN_RELEASE}-slim"],
}


def _name(path: Path) -> str:
    return str(path.relative_to(IMAGES))


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


def global_args(path: Path) -> dict[str, str]:
    """The ARGs before the first FROM (the only ones a FROM can use), in order."""
    out: dict[str, str] = {}
    for ins, rest in instructions(path):
        if ins == "FROM":
            break
        if ins == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            out[name.strip()] = value.strip().strip('"')
    return out


def test_dockerfiles_exist() -> None:
    assert {_name(p) for p in DOCKERFILES} == {
        "view-job.Dockerfile", "airflow.Dockerfile", "analyst.Dockerfile", "bases/python.Dockerfile",
        "bases/maven.Dockerfile",
        "bases/airflow.Dockerfile", "bases/kafka.Dockerfile", "bases/postgres.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_name)
def test_build_arg_defaults_equal_versions_env(dockerfile: Path) -> None:
    pins = h.versions()
    args = arg_defaults(dockerfile)
    assert args, "pinned build ARGs expected"
    for name, defaults in args.items():
        if name.endswith("_IMAGE"):
            continue  # base images: test_base_image_args_default_to_the_official_images
        assert name in pins, f"{_name(dockerfile)}: ARG {name} has no pin in infra/versions.env"
        assert set(defaults) == {pins[name]}, f"{_name(dockerfile)}: ARG {name}={defaults} but versions.env has {pins[name]}"
    required = {"view-job.Dockerfile": {"PYTHON_VERSION", "SPARK_VERSION", "DELTA_VERSION", "DELTA_SPARK_ARTIFACT",
                                        "KAFKA_VERSION", "SCALA_BINARY", "DEBIAN_RELEASE", "MAVEN_IMAGE_TAG",
                                        "PYTHON_IMAGE", "MAVEN_IMAGE"},
                "airflow.Dockerfile": {"AIRFLOW_VERSION", "PYTHON_VERSION", "KAPPA_VERSION", "AIRFLOW_IMAGE",
                                       "VIEW_JOB_IMAGE"},
                "analyst.Dockerfile": {"PYTHON_VERSION", "DEBIAN_RELEASE", "PYTHON_IMAGE"},
                "bases/python.Dockerfile": {"PYTHON_VERSION", "DEBIAN_RELEASE", "DEBIAN_IMAGE"},
                "bases/maven.Dockerfile": {"DEBIAN_RELEASE", "DEBIAN_IMAGE"},
                "bases/airflow.Dockerfile": {"AIRFLOW_VERSION", "PYTHON_VERSION", "PYTHON_IMAGE",
                                             "AIRFLOW_PROVIDERS_CNCF_KUBERNETES_VERSION",
                                             "AIRFLOW_PROVIDERS_POSTGRES_VERSION", "AIRFLOW_KUBERNETES_CLIENT_VERSION"},
                "bases/kafka.Dockerfile": {"KAFKA_VERSION", "SCALA_BINARY", "LOG4J2_VERSION", "DEBIAN_IMAGE",
                                           "MAVEN_IMAGE"},
                "bases/postgres.Dockerfile": {"POSTGRES_DEBIAN_RELEASE", "POSTGRES_MAJOR", "DEBIAN_IMAGE"},
                }[_name(dockerfile)]
    assert required <= set(args), f"{_name(dockerfile)}: missing pinned ARGs {sorted(required - set(args))}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_name)
def test_base_image_args_default_to_the_official_images(dockerfile: Path) -> None:
    """A base image is a global ARG ``<X>_IMAGE`` whose default names the official image, its tag made of pinned
    ARGs declared before it (ARG-in-ARG expansion: BuildKit and buildah both do it); no other ARG holds one."""
    pins = h.versions()
    declared: dict[str, str] = {}
    for name, default in global_args(dockerfile).items():
        if name.endswith("_IMAGE"):
            refs = re.findall(r"\$\{(\w+)\}", default)
            assert refs, f"{_name(dockerfile)}: {name}={default} takes no pinned ARG"
            for ref in refs:
                assert ref in declared, f"{_name(dockerfile)}: {name} uses ${{{ref}}}, not a global ARG declared before it"
            expanded = re.sub(r"\$\{(\w+)\}", lambda m: declared[m.group(1)], default)
            official = [form.format(**pins) for form in OFFICIAL_IMAGES[name]]
            assert expanded in official, f"{_name(dockerfile)}: {name} defaults to {expanded}, not {official}"
            assert "latest" not in expanded and ":" in expanded
        declared[name] = default
    for name in arg_defaults(dockerfile):
        if name.endswith("_IMAGE"):
            assert name in global_args(dockerfile), f"{_name(dockerfile)}: ARG {name} must be global (a FROM uses it)"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_name)
def test_base_images_are_pinned_by_args(dockerfile: Path) -> None:
    froms = [rest.split()[0] for ins, rest in instructions(dockerfile) if ins == "FROM"]
    assert froms
    stages = {rest.split()[-1] for ins, rest in instructions(dockerfile) if ins == "FROM" and " AS " in rest.upper()}
    image_args = {name for name in global_args(dockerfile) if name.endswith("_IMAGE")}
    for ref in froms:
        if ref in stages:
            continue
        m = re.fullmatch(r"\$\{(\w+)\}", ref)
        assert m and m.group(1) in image_args, f"{_name(dockerfile)}: FROM {ref} is not a base-image build arg"
    used = {re.fullmatch(r"\$\{(\w+)\}", r).group(1) for r in froms if r not in stages}
    assert used == image_args, f"{_name(dockerfile)}: base-image args {sorted(image_args - used)} are not used"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_name)
def test_the_local_build_passes_a_local_base_for_every_base_image_arg(dockerfile: Path) -> None:
    """build.sh never lets a build fall back to an official image (no registry here): each of the Dockerfile's
    base-image args gets a localhost/ image."""
    script = BUILD_SH.read_text()
    rel = str(dockerfile.relative_to(h.ROOT))
    m = re.search(rf"^\s*build [\w-]+ {re.escape(rel)} (.*?)^\s*record ", script, re.M | re.S)
    assert m, f"build.sh does not build {rel}"
    passed = set(re.findall(r"--build-arg (\w+)=", m.group(1)))
    image_args = {name for name in global_args(dockerfile) if name.endswith("_IMAGE")}
    assert passed == image_args, f"build.sh passes {sorted(passed)} to {rel}, its base-image args are {sorted(image_args)}"
    for name in image_args:
        var = re.search(rf"--build-arg {name}=\"\$(\w+)\"", m.group(1)).group(1)
        assert _resolve(script, var).startswith("localhost/"), f"{rel}: {name} gets ${var}, not a localhost/ image"


def _resolve(script: str, var: str) -> str:
    """The value build.sh assigns to a variable, with a leading ``$OTHER`` resolved the same way."""
    values = re.findall(rf'^\s*{var}="([^"]*)"', script, re.M)
    assert values, f"build.sh never assigns {var}"
    value = values[-1]
    m = re.match(r"\$(\w+)", value)
    return _resolve(script, m.group(1)) + value[m.end():] if m else value


def _ignore_patterns(dockerfile: Path) -> list[str]:
    return [line.strip() for line in Path(f"{dockerfile}.dockerignore").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_name)
def test_copy_sources_exist(dockerfile: Path) -> None:
    patterns = _ignore_patterns(dockerfile)
    allow_list = patterns[:1] == ["*"]
    for ins, rest in instructions(dockerfile):
        if ins not in ("COPY", "ADD"):
            continue
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        if "--from=" in rest:
            continue
        for src in parts[:-1]:
            assert (h.ROOT / src).exists(), f"{_name(dockerfile)}: COPY source {src} does not exist"
            if allow_list:  # "*" then "!<path>" exceptions: each source must be let back in
                assert any(src.rstrip("/") == p[1:].rstrip("/") or src.startswith(p[1:].rstrip("/") + "/")
                           for p in patterns if p.startswith("!")), \
                    f"{_name(dockerfile)}: COPY {src} is left out of the build context by its .dockerignore"


def _kappa_imports(path: Path) -> set[str]:
    """Every ``kappa`` module a file imports, at the top or inside a function (what a run may import)."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kappa":
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from kappa import process`
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.split(".")[0] == "kappa")
    return out


def test_the_class_data_stage_copies_every_module_its_dump_imports() -> None:
    """The view-job image dumps the drivers' class-data archive with a few modules copied alone (so a code change
    elsewhere keeps that layer): each module those import - at the top or in a function the dump runs - must be
    copied with them, or the image fails to build once that layer is rebuilt."""
    copied: set[str] = set()
    for ins, rest in instructions(IMAGES / "view-job.Dockerfile"):
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        if ins == "COPY" and parts[-1].startswith("/tmp/cds/"):
            copied.update(src for src in parts[:-1] if src.endswith(".py"))
    assert "kappa/runtime/cds.py" in copied

    def file_of(module: str) -> str | None:
        base = Path(*module.split("."))
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if (h.ROOT / candidate).is_file():
                return str(candidate)
        return None  # a name imported from a module, not a module

    missing = {}
    for src in sorted(copied):
        for module in _kappa_imports(h.ROOT / src):
            needed = file_of(module)
            if needed is not None and needed not in copied:
                missing[needed] = src
    assert not missing, f"view-job.Dockerfile's class-data stage lacks {missing} (module: imported by)"


@pytest.mark.parametrize(("dockerfile", "uid", "image_repo"), [
    ("view-job.Dockerfile", 10001, "kappa/view-job"), ("airflow.Dockerfile", 50000, "kappa/airflow"),
    ("bases/airflow.Dockerfile", 50000, "kappa/airflow"), ("bases/kafka.Dockerfile", 10001, "docker.io/apache/kafka")])
def test_images_run_as_the_chart_uid(dockerfile: str, uid: int, image_repo: str, default_objs: list[dict]) -> None:
    users = [rest for ins, rest in instructions(IMAGES / dockerfile) if ins == "USER"]
    final = users[-1].split(":")[0]
    assert final.isdigit() and int(final) == uid, f"{dockerfile}: final USER {users[-1]} (numeric non-root expected)"
    pods = [w for w in h.workloads(default_objs) if h.pod_spec(w)["containers"][0]["image"].startswith(image_repo)]
    assert pods
    for w in pods:
        assert h.pod_spec(w)["securityContext"]["runAsUser"] == uid, w["metadata"]["name"]


def test_the_postgres_image_runs_non_root_and_the_chart_picks_the_uid(default_objs: list[dict]) -> None:
    users = [rest for ins, rest in instructions(BASES / "postgres.Dockerfile") if ins == "USER"]
    assert users[-1] == "999:999", "the postgres user of the official image, numeric"
    sts = h.named(default_objs, "StatefulSet", "kappa-postgresql")
    assert h.pod_spec(sts)["securityContext"]["runAsUser"] == 10001  # any uid: the entrypoint handles it


def _unset_properties(pom: Path) -> set[str]:
    return set(re.findall(r"<([A-Za-z0-9.]+)>UNSET</\1>", pom.read_text()))


def _profile_properties(pom: Path, profile: str) -> set[str]:
    """The ${...} properties a profile of the POM uses (the UNSET ones must be passed)."""
    text = pom.read_text()
    block = re.search(rf"<profile>\s*<id>{profile}</id>(.*?)</profile>", text, re.S).group(1)
    return set(re.findall(r"\$\{([A-Za-z0-9.]+)\}", block)) & _unset_properties(pom)


def test_every_maven_property_is_passed_pinned() -> None:
    text = (IMAGES / "view-job.Dockerfile").read_text()
    passed = set(re.findall(r"-D([A-Za-z0-9.]+)=", text))
    pom = h.ROOT / "infra" / "local" / "pom.xml"  # its spark and s3a profiles, as `make setup` resolves them
    missing = (_profile_properties(pom, "spark") | _profile_properties(pom, "s3a")) - passed
    assert not missing, f"{pom.name}: properties {sorted(missing)} are not passed by view-job.Dockerfile"
    assert not any("spark.jars.packages" in rest for _, rest in instructions(IMAGES / "view-job.Dockerfile"))
    # the Kafka image: the broker profile of the same POM, and the tools POM
    text = (BASES / "kafka.Dockerfile").read_text()
    passed = set(re.findall(r"-D([A-Za-z0-9.]+)=", text))
    missing = (_profile_properties(h.ROOT / "infra" / "local" / "pom.xml", "broker") | {"scala.binary"}
               | _unset_properties(BASES / "kafka-tools.pom.xml")) - passed
    assert not missing, f"kafka.Dockerfile does not pass {sorted(missing)}"


@pytest.mark.parametrize("dockerfile", ["view-job.Dockerfile", "bases/kafka.Dockerfile"])
def test_maven_resolves_from_central_only(dockerfile: str) -> None:
    """Every mvn run uses infra/local/maven-settings.xml (a POM's own repositories, like the GCS mirror in Spark's
    parent POM, are mirrored to Central) and keeps its downloads in a build cache mount."""
    runs = [rest for ins, rest in instructions(IMAGES / dockerfile) if ins == "RUN" and "mvn " in rest]
    assert runs
    assert "COPY infra/local/maven-settings.xml /build/maven-settings.xml" in (IMAGES / dockerfile).read_text()
    for rest in runs:
        assert rest.startswith("--mount=type=cache,target=/root/.m2 "), rest[:80]
        calls = re.findall(r"\bmvn (.*?)(?:;|$)", rest)
        assert calls and all("-s /build/maven-settings.xml" in call for call in calls), calls


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


def _stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    """The instructions of each build stage, by its name (``AS <name>``; the last, unnamed one is ``""``)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for ins, rest in instructions(path):
        if ins == "FROM":
            words = rest.split()
            name = words[words.index("AS") + 1] if "AS" in words else ""
            current = stages.setdefault(name, [("FROM", rest)])
        elif current is not None:
            current.append((ins, rest))
    return stages


def _sql_jar(settings) -> Path:
    from kappa.front.sql.server import jar_path

    return jar_path(settings)


def _forkless_jar(settings) -> Path:
    from kappa.runtime.spark import forkless_jar

    return forkless_jar(settings)


# the project's Java, compiled in the image as `make setup` compiles it: (stage, sources, one of them, where the
# runtime looks in the image's repository, the image's own check that it is there)
_JAVA_JARS = {
    # `kappa sql serve` (the chart's <fullname>-sql Deployment) refuses to start without the guards' jar
    "sql guards": ("sql", "kappa/front/sql/java", "kappa/sql/ReadOnly.java", _sql_jar,
                   "p = jar_path(Settings.from_env()); assert p.is_file()", "/opt/kappa/.cache/jars/sql/kappa-sql.jar"),
    # every local driver (the grouped driver, replays, the SQL service) puts it on its class path when it is there
    "forkless local fs": ("hadoop", "kappa/runtime/java", "kappa/hadoop/ForklessRawLocalFileSystem.java",
                          _forkless_jar, "forkless_fs(Settings.from_env(), 'local[2]')",
                          "/opt/kappa/.cache/jars/hadoop/kappa-hadoop.jar"),
}


@pytest.mark.parametrize("what", sorted(_JAVA_JARS))
def test_view_job_image_builds_the_projects_java(what: str) -> None:
    """The image compiles the project's Java with a JDK against its own pyspark's jars, as `make setup` does, and
    puts each jar where the code that loads it looks in the image's repository (/opt/kappa)."""
    from kappa.config import Settings

    stage_name, source_dir, marker, where, check, path = _JAVA_JARS[what]
    stages = _stages(IMAGES / "view-job.Dockerfile")
    stage = stages[stage_name]
    assert stage[0][1].startswith("${MAVEN_IMAGE} "), "the JDK of the Maven image (the runtime has a JRE only)"
    copies = [rest for ins, rest in stage if ins == "COPY"]
    assert "--from=python /opt/venv/lib/python${PYTHON_VERSION}/site-packages/pyspark/jars /pyspark-jars" in copies
    source = next(c for c in copies if not c.startswith("--from="))
    src, dst = source.split()
    assert src == source_dir and (h.ROOT / src / marker).is_file()
    run = " ".join(rest for ins, rest in stage if ins == "RUN")
    javac = re.search(r"\bjavac ([^;]*)", run).group(1)
    assert "--release 17" in javac and '-cp "/pyspark-jars/*"' in javac and dst in javac
    classes = re.search(r"-d (\S+)", javac).group(1)
    built = re.search(rf"\bjar cf (\S+) -C {re.escape(classes)} kappa\b", run)
    assert built, run
    runtime = stages[""]
    assert ("WORKDIR", "/opt/kappa") in runtime
    want = where(Settings.from_env({"KAPPA_REPO_ROOT": "/opt/kappa"}))
    assert want == Path(path)
    copied = [i for i, (ins, rest) in enumerate(runtime)
              if ins == "COPY" and rest == f"--from={stage_name} {built.group(1)} {want.relative_to('/opt/kappa')}"]
    assert len(copied) == 1, [rest for ins, rest in runtime if ins == "COPY" and rest.startswith(f"--from={stage_name} ")]
    # the image's own check: the path the code reads holds the jar
    assert any(check in rest for ins, rest in runtime if ins == "RUN"), check
    if stage_name == "hadoop":  # on the drivers' class path: their class-data archive is dumped with it in place
        dump = next(i for i, (ins, rest) in enumerate(runtime) if ins == "RUN" and "-m kappa.runtime.cds" in rest)
        assert copied[0] < dump, (copied, dump)


def test_the_sql_service_runs_from_the_view_job_image(default_objs: list[dict]) -> None:
    sql_deploy = h.named(default_objs, "Deployment", "kappa-sql")
    assert h.pod_spec(sql_deploy)["containers"][0]["image"] == f"kappa/view-job:{h.versions()['KAPPA_VERSION']}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_name)
def test_dockerignore_keeps_caches_out(dockerfile: Path) -> None:
    patterns = _ignore_patterns(dockerfile)
    # either everything out but an allow-list, or at least the caches and the repository's history
    assert patterns[:1] == ["*"] or {".git", ".cache", ".kappa"} <= set(patterns), patterns
    assert not any(p.startswith("!") and p[1:].split("/")[0] in (".git", ".cache", ".kappa") for p in patterns)


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


def test_local_values_name_the_images_make_images_builds() -> None:
    """infra/images/local-values.yaml points the chart at exactly the tags infra/images/build.sh builds, never pulled."""
    listed = subprocess.run(["bash", str(h.ROOT / "infra" / "images" / "build.sh"), "list"], capture_output=True,
                            text=True, check=True).stdout.split()
    overlay = yaml.safe_load((h.ROOT / "infra" / "images" / "local-values.yaml").read_text())
    pins = h.versions()

    def ref(image: dict, default_repo: str, default_tag: str) -> str:
        return f"{image['registry']}/{image.get('repository', default_repo)}:{image.get('tag', default_tag)}"

    used = {ref(overlay["image"], "kappa/view-job", pins["KAPPA_VERSION"]),
            ref(overlay["airflow"]["image"], "kappa/airflow", pins["KAPPA_VERSION"]),
            ref(overlay["kafka"]["image"], "", "")}
    postgres = ref(overlay["airflow"]["postgresql"]["image"], "", "")
    # build.sh tags PostgreSQL with the 17.x Debian ships and with the major alone; the values use the stable major
    built_postgres = [r for r in listed if r.startswith("localhost/kappa/postgres:")]
    assert used == set(listed) - set(built_postgres), (used, listed)
    assert [r.rsplit(".", 1)[0] for r in built_postgres] == [postgres], (postgres, built_postgres)
    for image in (overlay["image"], overlay["airflow"]["image"], overlay["kafka"]["image"],
                  overlay["airflow"]["postgresql"]["image"]):
        assert image["pullPolicy"] == "Never", "side-loaded images: a pull attempt can only fail"
    assert overlay["kafka"]["image"]["tag"] == pins["KAFKA_IMAGE_TAG"]
    assert overlay["airflow"]["postgresql"]["image"]["tag"] == pins["POSTGRES_MAJOR"]


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
        subprocess.run(["bash", str(h.ROOT / "infra" / "verify-offline.sh"), "--tools", "all"], check=True, cwd=h.ROOT,
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


# ------------------------------------------------------------------------------------------ local base entrypoints
def test_airflow_base_entrypoint_runs_commands_as_the_official_one(tmp_path: Path) -> None:
    """bases/airflow-entrypoint.sh: `airflow X` and a bare `X` both run `airflow X`; bash/python run directly;
    umask 0002; `airflow db check` is retried CONNECTION_CHECK_MAX_COUNT times before anything runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "airflow"
    fake.write_text('#!/bin/sh\nif [ "$1 $2" = "db check" ]; then exit "${FAKE_DB_CHECK_RC:-0}"; fi\n'
                    'echo "airflow $*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "AIRFLOW_USER_HOME_DIR": str(tmp_path), "HOME": str(tmp_path),
           "CONNECTION_CHECK_SLEEP_TIME": "0"}
    entrypoint = str(BASES / "airflow-entrypoint.sh")

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", entrypoint, *args], env={**env, **extra}, capture_output=True, text=True)

    assert run("airflow", "version").stdout == "airflow version\n"
    assert run("version").stdout == "airflow version\n"
    assert run("scheduler", "--help").stdout == "airflow scheduler --help\n"
    assert run("bash", "-c", "umask").stdout.strip() == "0002"
    assert run("python", "-c", "print('py')").stdout.strip() == "py"
    failed = run("airflow", "version", CONNECTION_CHECK_MAX_COUNT="3", FAKE_DB_CHECK_RC="1")
    assert failed.returncode == 1 and "Maximum number of retries (3) reached" in failed.stderr
    assert run("airflow", "version", CONNECTION_CHECK_MAX_COUNT="0", FAKE_DB_CHECK_RC="1").returncode == 0


def _fake_kafka_home(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    home = tmp_path / "kafka"
    shutil.copytree(BASES / "kafka", home)
    env = {"PATH": os.environ["PATH"], "JAVA_HOME": str(_fake_java(tmp_path)), "LOG_DIR": str(tmp_path / "logs")}
    return home, env


def test_kafka_scripts_honour_the_apache_variables(tmp_path: Path) -> None:
    """bases/kafka/bin: kafka-server-start.sh and kafka-storage.sh start the right classes with Apache's defaults
    and variables (KAFKA_HEAP_OPTS, KAFKA_OPTS, LOG_DIR for the GC log, the log4j2 config), as start.sh needs."""
    home, env = _fake_kafka_home(tmp_path)
    res = subprocess.run([str(home / "bin" / "kafka-server-start.sh"), "/tmp/server.properties"], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    args = res.stdout.splitlines()
    assert args[:2] == ["-Xmx1G", "-Xms1G"], "kafka-server-start.sh's default heap"
    assert args[-2:] == ["kafka.Kafka", "/tmp/server.properties"]
    assert args[args.index("-cp") + 1] == f"{home}/libs/*"
    assert f"-Xlog:gc*:file={tmp_path}/logs/kafkaServer-gc.log:time,tags:filecount=10,filesize=100M" in args
    assert f"-Dlog4j2.configurationFile={home}/bin/../config/log4j2.properties" in args
    assert f"-Dkafka.logs.dir={tmp_path}/logs" in args and (tmp_path / "logs").is_dir()
    env.update(KAFKA_HEAP_OPTS="-Xms512m -Xmx512m", KAFKA_OPTS="-Dextra=1")
    res = subprocess.run([str(home / "bin" / "kafka-storage.sh"), "format", "--ignore-formatted"], env=env,
                         capture_output=True, text=True)
    args = res.stdout.splitlines()
    assert args[:2] == ["-Xms512m", "-Xmx512m"] and "-Dextra=1" in args
    assert args[-3:] == ["kafka.tools.StorageTool", "format", "--ignore-formatted"]
    assert f"-Dlog4j2.configurationFile={home}/config/tools-log4j2.properties" in args
    assert not any(a.startswith("-Xlog:gc") for a in args), "only the server writes a GC log"
