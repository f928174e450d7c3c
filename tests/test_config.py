"""Settings from the environment, version pins, platform catalog."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kappa.catalog import CatalogError, UnknownView, load_catalog, parse_catalog
from kappa.config import ConfigError, Settings
from kappa.versions import VersionsError, parse_versions, read_versions

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------- settings
def test_defaults() -> None:
    s = Settings.from_env({})
    assert s.repo_root == REPO
    assert s.home == REPO / ".kappa" and s.lake_uri == str(REPO / ".kappa" / "lake")
    assert s.kafka_bootstrap == "127.0.0.1:9092" and s.local_broker
    assert s.jars_dir == REPO / ".cache" / "jars" and s.broker_home == REPO / ".kappa" / "broker"
    assert s.kafka_client_config() == {"bootstrap.servers": "127.0.0.1:9092"}
    assert s.spark_kafka_options() == {"kafka.bootstrap.servers": "127.0.0.1:9092"}


def test_the_view_hosts_heap_ceiling_comes_from_the_environment_unless_its_command_names_one(tmp_path) -> None:
    from kappa.runtime.host import ViewHost

    assert Settings.from_env({}).host_driver_memory == "768m"
    settings = Settings.from_env({"KAPPA_HOME": str(tmp_path), "KAPPA_HOST_DRIVER_MEMORY": "1536m"})
    assert ViewHost(settings).driver_memory == "1536m"  # what its Spark session is built with
    assert ViewHost(settings, driver_memory="2g").driver_memory == "2g"  # kappa host run --driver-memory 2g


def test_external_cluster_and_lake(tmp_path: Path) -> None:
    s = Settings.from_env({"KAPPA_HOME": str(tmp_path), "KAPPA_KAFKA_BOOTSTRAP": "k1:9092,k2:9092",
                           "KAPPA_LAKE_URI": "s3a://bucket/lake"})
    assert not s.local_broker and s.kafka_bootstrap == "k1:9092,k2:9092"
    assert s.home == tmp_path and s.lake_uri == "s3a://bucket/lake"


def test_a_tables_history_is_an_hour_on_a_local_lake_and_deltas_own_on_an_object_store(tmp_path: Path) -> None:
    local = Settings.from_env({"KAPPA_HOME": str(tmp_path)})
    assert local.history_hours is None and local.table_history_hours == 1.0
    assert Settings.from_env({"KAPPA_LAKE_URI": "file:///data/lake"}).table_history_hours == 1.0
    s3 = Settings.from_env({"KAPPA_LAKE_URI": "s3a://bucket/lake"})
    assert s3.table_history_hours is None  # Delta's retentions: 7 days of files, 30 of log
    assert Settings.from_env({"KAPPA_LAKE_URI": "s3a://b/l", "KAPPA_HISTORY_HOURS": "168"}).table_history_hours == 168
    assert Settings.from_env({"KAPPA_HISTORY_HOURS": "0.5"}).table_history_hours == 0.5
    for bad, message in (("0", "a number of hours above 0"), ("-1", "a number of hours above 0"),
                         ("a day", "not a number")):
        with pytest.raises(ConfigError, match=message):
            Settings.from_env({"KAPPA_HISTORY_HOURS": bad})


def test_sasl_ssl() -> None:
    s = Settings.from_env({
        "KAPPA_KAFKA_BOOTSTRAP": "k:9093", "KAPPA_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
        "KAPPA_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "KAPPA_KAFKA_SASL_USERNAME": "u",
        "KAPPA_KAFKA_SASL_PASSWORD": 'p"w', "KAPPA_KAFKA_SSL_CA_LOCATION": "/ca.pem",
    })
    assert s.kafka_client_config() == {
        "bootstrap.servers": "k:9093", "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u", "sasl.password": 'p"w', "ssl.ca.location": "/ca.pem",
    }
    opts = s.spark_kafka_options()
    assert opts["kafka.security.protocol"] == "SASL_SSL"
    assert opts["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="u" password="p\\"w";'
    )
    assert opts["kafka.ssl.truststore.type"] == "PEM" and opts["kafka.ssl.truststore.location"] == "/ca.pem"
    assert all(k.startswith("kafka.") for k in opts)
    assert "p\"w" not in repr(s)  # password never in repr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KAPPA_KAFKA_SECURITY_PROTOCOL": "TLS"}, "KAPPA_KAFKA_SECURITY_PROTOCOL"),
        ({"KAPPA_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"}, "KAPPA_KAFKA_SASL_MECHANISM"),
        ({"KAPPA_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KAPPA_KAFKA_SASL_MECHANISM": "PLAIN"},
         "KAPPA_KAFKA_SASL_USERNAME"),
        ({"KAPPA_KAFKA_SASL_USERNAME": "u"}, "SASL settings given"),
        ({"KAPPA_KAFKA_SSL_CA_LOCATION": "/ca.pem"}, "KAPPA_KAFKA_SSL_CA_LOCATION"),
        ({"KAPPA_DRIVER_LEASE_SECONDS": "1"}, "KAPPA_DRIVER_LEASE_SECONDS=1: at least 3"),
        ({"KAPPA_SPARK_CDS": "maybe"}, "KAPPA_SPARK_CDS='maybe': not a yes/no setting"),
        ({"KAPPA_VERIFY_CACHE_MB": "-1"}, r"KAPPA_VERIFY_CACHE_MB=-1: 0 \(keep nothing\) or more"),
        ({"KAPPA_VERIFY_CACHE_MB": "lots"}, "KAPPA_VERIFY_CACHE_MB='lots': not an integer"),
        ({"KAPPA_HOST_DRIVER_MEMORY": "2 GB"}, "KAPPA_HOST_DRIVER_MEMORY='2 GB': a JVM heap size such as 1536m or 2g"),
        ({"KAPPA_SPARK_TRIM_SECONDS": "-5"}, r"KAPPA_SPARK_TRIM_SECONDS=-5: 0 \(never\) or more seconds"),
        ({"KAPPA_SPARK_TRIM_SECONDS": "often"}, "KAPPA_SPARK_TRIM_SECONDS='often': not a number"),
    ],
)
def test_inconsistent_security_settings(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(env)


@pytest.mark.parametrize(("value", "expected"), [("off", False), ("0", False), ("No", False), ("on", True),
                                               ("TRUE", True), ("", True)])
def test_yes_no_settings_take_every_usual_spelling(value: str, expected: bool) -> None:
    assert Settings.from_env({"KAPPA_SPARK_CDS": value}).spark_cds is expected
    assert Settings.from_env({"KAPPA_SPARK_UI": value}).spark_ui is (expected and value != "")


# ------------------------------------------------------------------------------------- versions
def test_versions_env_parsed() -> None:
    v = read_versions()
    for key in ("SPARK_VERSION", "DELTA_VERSION", "DELTA_SPARK_ARTIFACT", "KAFKA_VERSION", "AIRFLOW_VERSION",
                "AIRFLOW_CLIENT_VERSION",
                "CONFLUENT_KAFKA_VERSION", "PROMETHEUS_CLIENT_VERSION", "PYTHON_VERSION", "SCALA_BINARY"):
        assert v[key], key
    assert parse_versions('# c\nA=1\nexport B="x y"\nC=2 # trailing\n') == {"A": "1", "B": "x y", "C": "2"}
    with pytest.raises(VersionsError, match="duplicate"):
        parse_versions("A=1\nA=2")


def test_lock_matches_pins() -> None:
    """requirements.lock (make setup installs it) carries exactly the versions.env pins."""
    v = read_versions()
    lock = {
        re.sub(r"[-_.]+", "-", name).lower(): ver
        for name, ver in (line.split("==", 1) for line in (REPO / "requirements.lock").read_text().splitlines()
                          if line and not line.startswith("#"))
    }
    assert lock["pyspark"] == v["SPARK_VERSION"]
    assert lock["delta-spark"] == v["DELTA_VERSION"]
    assert lock["apache-airflow"] == v["AIRFLOW_VERSION"]
    assert lock["apache-airflow-client"] == v["AIRFLOW_CLIENT_VERSION"]
    assert lock["confluent-kafka"] == v["CONFLUENT_KAFKA_VERSION"]
    assert lock["prometheus-client"] == v["PROMETHEUS_CLIENT_VERSION"]
    assert "kappa" not in lock


def test_installed_pyspark_matches_pin() -> None:
    import importlib.metadata as md

    assert md.version("pyspark") == read_versions()["SPARK_VERSION"]
    assert md.version("delta-spark") == read_versions()["DELTA_VERSION"]


# -------------------------------------------------------------------------------------- catalog
def test_platform_catalog() -> None:
    cat = load_catalog()
    assert set(cat.topics) == {"ad-events", "campaigns", "campaign-windows.v1", "campaign-windows.v2"}
    assert cat.topic("campaign-windows.v1").partitions == 1  # published windows stay in event-time order
    assert cat.topic("campaign-windows.v2").config["cleanup.policy"] == "compact"
    assert cat.topic("ad-events").partitions == 4
    assert cat.topic("campaigns").config["cleanup.policy"] == "compact"
    assert cat.view("campaign_window_counts").topics == ("ad-events", "campaigns")
    assert cat.view("events_raw").module() == "jobs.events_raw.v1"
    assert cat.module_of("campaign_window_counts") == "jobs.campaign_window_counts.v1"  # the default version
    assert cat.module_of("campaign_window_counts", 2) == "jobs.campaign_window_counts.v2"
    assert cat.view("ad_events_archive").archives == "ad-events" and cat.view("events_raw").archives is None
    assert cat.view("ad_events_archive").retention_ms == 730 * 86_400_000 and cat.view("events_raw").retention_ms is None
    with pytest.raises(UnknownView, match="^unknown view 'nope'; declared views: ad_events_archive, campaign_catalog, "):
        cat.view("nope")
    with pytest.raises(UnknownView, match=r"^events_raw has no version 3 in kappa/platform.yaml \(declared: 1, 2\)$"):
        cat.module_of("events_raw", 3)


def test_the_declared_views_of_views_form_a_graph_without_problems() -> None:
    """Each campaign_hourly_totals version reads the topic one campaign_window_counts version publishes; a catalog
    with two publishers of one topic, or a publish topic it does not declare, is reported."""
    import dataclasses

    from kappa.control.replay.cascade import chain, graph, graph_problems

    cat = load_catalog()
    assert [str(e) for e in graph(cat)] == [
        "campaign_hourly_totals@v1 <- campaign-windows.v1 <- campaign_window_counts@v1",
        "campaign_hourly_totals@v2 <- campaign-windows.v2 <- campaign_window_counts@v2"]
    assert graph_problems(cat) == []
    assert chain("campaign_window_counts", 2) == [("campaign_hourly_totals", 2)]
    twice = dataclasses.replace(cat, views={**cat.views, "copy": dataclasses.replace(
        cat.view("campaign_window_counts"), name="copy", versions={1: "jobs.campaign_window_counts.v1"})})
    assert graph_problems(twice) == ["copy@v1 and campaign_window_counts@v1 both publish to campaign-windows.v1 "
                                     "(one topic per publishing version)"]
    undeclared = dataclasses.replace(cat, topics={k: v for k, v in cat.topics.items() if k != "campaign-windows.v2"})
    assert graph_problems(undeclared) == ["campaign_window_counts@v2 publishes to campaign-windows.v2, which "
                                          "platform.yaml does not declare"]


def test_an_archives_retention_is_parsed_and_misuse_is_named() -> None:
    """``retention`` beside ``archives``: <n>d|h|m|s or forever; anything else, or a retention on a view that
    archives nothing, is reported with its place in the file."""
    def view(**extra: object) -> dict:
        return {"topics": {"t": {"partitions": 1}},
                "views": {"a": {"topics": ["t"], "default_version": 1, "versions": {1: {"module": "jobs.a.v1"}},
                                **extra}}}

    assert parse_catalog(view(archives="t", retention="36h"), source="x").views["a"].retention_ms == 36 * 3_600_000
    assert parse_catalog(view(archives="t", retention="forever"), source="x").views["a"].retention_ms is None
    for extra, message in (({"archives": "t", "retention": "2 weeks"},
                            "views.a.retention: '2 weeks' is not <n>d, <n>h, <n>m, <n>s or forever"),
                           ({"retention": "30d"}, "views.a.retention: only an archive has a retention of its own")):
        with pytest.raises(CatalogError) as info:
            parse_catalog(view(**extra), source="x")
        assert message in str(info.value), info.value


def test_a_views_trigger_is_parsed_and_wins_over_what_its_module_declares(tmp_path, monkeypatch) -> None:
    """``trigger: <n>s|m`` in platform.yaml sets how often a view's live micro-batches run, whatever its versions'
    modules declare; without it a module's own (hourly totals: 10 s) holds, else 2 s; a driver's explicit
    ``--trigger-seconds`` wins over both. Misuse is named with its place in the file."""
    import yaml

    from kappa.runtime.job import live_trigger_seconds
    from kappa.runtime.view import load_view

    def view(**extra: object) -> dict:
        return {"topics": {"t": {"partitions": 1}},
                "views": {"a": {"topics": ["t"], "default_version": 1, "versions": {1: {"module": "jobs.a.v1"}},
                                **extra}}}

    assert parse_catalog(view(trigger="90s"), source="x").views["a"].trigger_seconds == 90
    assert parse_catalog(view(trigger="5m"), source="x").views["a"].trigger_seconds == 300
    assert parse_catalog(view(), source="x").views["a"].trigger_seconds is None
    for bad in ("2 s", "0s", "2h", "fast"):
        with pytest.raises(CatalogError) as info:
            parse_catalog(view(trigger=bad), source="x")
        assert f"views.a.trigger: {bad!r}: use <n>s or <n>m, at most 60m" in str(info.value), info.value

    archive, hourly = load_view("jobs.ad_events_archive.v1"), load_view("jobs.campaign_hourly_totals.v1")
    assert load_catalog().view("ad_events_archive").trigger_seconds == 30
    assert (live_trigger_seconds(archive), live_trigger_seconds(hourly),
            live_trigger_seconds(load_view("jobs.events_raw.v1"))) == (30, 10, 2)
    # a team's copy of platform.yaml declaring a trigger for the hourly totals: it wins over the module's 10 s
    doc = yaml.safe_load(Path(load_catalog().source).read_text())
    doc["views"]["campaign_hourly_totals"]["trigger"] = "1m"
    del doc["views"]["ad_events_archive"]["trigger"]
    copy = tmp_path / "platform.yaml"
    copy.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("KAPPA_PLATFORM", str(copy))
    assert (live_trigger_seconds(archive), live_trigger_seconds(hourly)) == (2, 60)

    from kappa.runtime.job import ViewJob

    settings = Settings.from_env()
    assert ViewJob(hourly, settings).trigger_seconds == 60
    assert ViewJob(hourly, settings, trigger_seconds=5).trigger_seconds == 5


def test_catalog_reports_every_problem() -> None:
    doc = {
        "topics": {"ok": {"partitions": 1}, "bad name!": {"partitions": 1},
                   "t2": {"partitions": 0, "config": {"retention.ms": [1]}}},
        "views": {"v": {"topics": ["ok", "missing"], "default_version": 2, "versions": {1: {"module": "jobs.v.v1"}}},
                  "w": {"topics": ["ok"], "default_version": 1, "versions": {1: {"module": "not a module"}}}},
        "extra": 1,
    }
    with pytest.raises(CatalogError) as info:
        parse_catalog(doc, source="x.yaml")
    text = str(info.value)
    for fragment in ("unknown top-level key(s): extra", "topics.bad name!: invalid", "topics.t2.partitions",
                     "topics.t2.config.retention.ms", "views.v.topics[1]: unknown topic 'missing'",
                     "views.v.default_version: 2 is not a declared version", "views.w.versions.1.module"):
        assert fragment in text, fragment
    assert len(info.value.errors) == 7
