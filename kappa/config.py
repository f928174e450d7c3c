"""Runtime settings of the platform, read from the environment.

Every component (CLI, jobs, DAGs, tests) builds one :class:`Settings` with :meth:`Settings.from_env` and
derives its client configuration from it, so pointing the whole platform somewhere else is a matter of
environment variables (empty = unset):

- ``KAPPA_HOME`` -- runtime state (broker data, lake, logs). Default ``<repo>/.kappa``.
- ``KAPPA_KAFKA_BOOTSTRAP`` -- Kafka bootstrap servers. Default ``127.0.0.1:9092``. Setting it means an
  *external* cluster: the platform then never starts a local broker (``Settings.local_broker`` is False).
- ``KAPPA_KAFKA_SECURITY_PROTOCOL`` -- ``PLAINTEXT`` (default), ``SSL``, ``SASL_PLAINTEXT``, ``SASL_SSL``.
- ``KAPPA_KAFKA_SASL_MECHANISM`` -- ``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512`` (with SASL_*).
- ``KAPPA_KAFKA_SASL_USERNAME`` / ``KAPPA_KAFKA_SASL_PASSWORD`` -- SASL credentials (password never in ``repr``).
- ``KAPPA_KAFKA_SSL_CA_LOCATION`` -- PEM file of the CA that signed the brokers' certificates (with SSL/SASL_SSL).
- ``KAPPA_LAKE_URI`` -- root of Delta tables, checkpoints and the view registry. Default ``<home>/lake``.
- ``KAPPA_REPO_ROOT`` -- repository root (jars, schemas, platform.yaml). Default: parent of the package.
- ``KAPPA_METRICS_ADDR`` -- address the drivers' ``/metrics`` servers bind. Default ``127.0.0.1`` (loopback);
  the Helm chart sets ``0.0.0.0`` so Prometheus can scrape the pods.
- ``KAPPA_CLI`` -- how messages spell the command line (``bin/kappa`` from a checkout, ``kappa`` in images).

Example:
    >>> from kappa.config import Settings
    >>> s = Settings.from_env({"KAPPA_HOME": "/tmp/k"})
    >>> s.kafka_bootstrap, s.local_broker, s.lake_uri
    ('127.0.0.1:9092', True, '/tmp/k/lake')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kappa.errors import KappaError

__all__ = [
    "DEFAULT_BOOTSTRAP",
    "SASL_MECHANISMS",
    "SECURITY_PROTOCOLS",
    "ConfigError",
    "Settings",
    "default_repo_root",
]

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
#: How long a replaced view version's table is kept for rollback before retirement deletes it (7 days). The one
#: default of the alias (kappa.serving), the replay request, the CLI and the DAGs' Params.
DEFAULT_KEEP_HOURS = 168.0
SECURITY_PROTOCOLS = frozenset({"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"})
SASL_MECHANISMS = frozenset({"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"})

_JAAS_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


class ConfigError(KappaError, ValueError):
    """Inconsistent or invalid settings (message names the environment variable)."""


def default_repo_root() -> Path:
    """The repository root: the directory above the ``kappa`` package (editable install)."""
    return Path(__file__).resolve().parents[1]


def _jaas_quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Immutable platform settings; build with :meth:`from_env`, derive variants with :meth:`replace`.

    Attributes:
        repo_root: Repository root (``infra/``, ``schemas/``, ``.cache/``).
        home: Runtime state directory (``KAPPA_HOME``).
        kafka_bootstrap: Bootstrap servers, ``host:port[,host:port...]``.
        local_broker: True when the platform manages a local broker (``KAPPA_KAFKA_BOOTSTRAP`` unset).
        security_protocol: Kafka security protocol, or None for PLAINTEXT.
        sasl_mechanism: SASL mechanism when the protocol is SASL_*.
        sasl_username: SASL user name.
        sasl_password: SASL password (excluded from ``repr``).
        ssl_ca_location: PEM CA bundle for SSL / SASL_SSL.
        lake_uri: Root URI/path of Delta tables, checkpoints and the view registry.
        topic_prefix: Prefix of every physical topic name (``KAPPA_TOPIC_PREFIX``).
        metrics_addr: Bind address of the Prometheus ``/metrics`` servers.
        cli: The command line as users invoke it, for the commands that messages suggest.
    """

    repo_root: Path
    home: Path
    kafka_bootstrap: str = DEFAULT_BOOTSTRAP
    local_broker: bool = True
    security_protocol: str | None = None
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_ca_location: str | None = None
    lake_uri: str = ""
    topic_prefix: str = ""
    metrics_addr: str = "127.0.0.1"
    cli: str = "kappa"

    def __post_init__(self) -> None:
        if not self.lake_uri:
            object.__setattr__(self, "lake_uri", str(self.home / "lake"))
        self._validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``os.environ`` (or the given mapping).

        Args:
            env: Environment to read; defaults to ``os.environ``. Empty values count as unset.

        Raises:
            ConfigError: If the security settings are inconsistent.
        """
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        repo_root = Path(get("KAPPA_REPO_ROOT") or default_repo_root()).resolve()
        home = Path(get("KAPPA_HOME") or repo_root / ".kappa").expanduser().resolve()
        bootstrap = get("KAPPA_KAFKA_BOOTSTRAP")
        protocol = get("KAPPA_KAFKA_SECURITY_PROTOCOL")
        mechanism = get("KAPPA_KAFKA_SASL_MECHANISM")
        return cls(
            repo_root=repo_root,
            home=home,
            kafka_bootstrap=bootstrap or DEFAULT_BOOTSTRAP,
            local_broker=bootstrap is None,
            security_protocol=protocol.upper() if protocol else None,
            sasl_mechanism=mechanism.upper() if mechanism else None,
            sasl_username=get("KAPPA_KAFKA_SASL_USERNAME"),
            sasl_password=get("KAPPA_KAFKA_SASL_PASSWORD"),
            ssl_ca_location=get("KAPPA_KAFKA_SSL_CA_LOCATION"),
            lake_uri=get("KAPPA_LAKE_URI") or "",
            topic_prefix=get("KAPPA_TOPIC_PREFIX") or "",
            metrics_addr=get("KAPPA_METRICS_ADDR") or "127.0.0.1",
            cli=get("KAPPA_CLI") or "kappa",
        )

    def replace(self, **changes: Any) -> Settings:
        """Return a copy with some fields changed (validated again).

        Changing ``home`` without ``lake_uri`` keeps a lake under the *old* home; pass ``lake_uri=""`` to
        re-derive it from the new home.
        """
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived paths
    def topic(self, name: str) -> str:
        """Physical Kafka topic of a declared topic (``KAPPA_TOPIC_PREFIX`` + name).

        A prefix lets several environments (or test runs) share one cluster without sharing data.
        """
        return f"{self.topic_prefix}{name}"

    @property
    def jars_dir(self) -> Path:
        """``<repo>/.cache/jars`` (``broker/`` and ``spark/`` sub-folders, filled by ``make setup``)."""
        return self.repo_root / ".cache" / "jars"

    @property
    def broker_home(self) -> Path:
        """Home of the local broker: ``<home>/broker`` (config, data, logs, pid file)."""
        return self.home / "broker"

    @property
    def platform_file(self) -> Path:
        """The platform declaration file: ``$KAPPA_PLATFORM``, else ``kappa/platform.yaml``."""
        from kappa.catalog import platform_file

        return platform_file()

    @property
    def schemas_dir(self) -> Path:
        """Versioned JSON Schemas, ``<repo>/schemas``."""
        return self.repo_root / "schemas"

    # ------------------------------------------------------------------ client configs
    def kafka_client_config(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """librdkafka configuration for confluent-kafka clients (Producer/Consumer/AdminClient).

        Args:
            overrides: Extra librdkafka properties merged last (e.g. ``{"client.id": "x"}``).

        Returns:
            A new dict with ``bootstrap.servers`` and the security settings.
        """
        conf: dict[str, Any] = {"bootstrap.servers": self.kafka_bootstrap}
        if self.security_protocol:
            conf["security.protocol"] = self.security_protocol
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username is not None:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password is not None:
            conf["sasl.password"] = self.sasl_password
        if self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        if overrides:
            conf.update(overrides)
        return conf

    def spark_kafka_options(self) -> dict[str, str]:
        """Options for Spark's Kafka source/sink (``spark.readStream.format("kafka").options(**...)``).

        All keys carry the ``kafka.`` prefix Spark forwards to the Java client. SASL credentials become a
        ``kafka.sasl.jaas.config``; an SSL CA file is passed as a PEM trust store (KIP-651).
        """
        opts: dict[str, str] = {"kafka.bootstrap.servers": self.kafka_bootstrap}
        if self.security_protocol:
            opts["kafka.security.protocol"] = self.security_protocol
        if self.sasl_mechanism:
            opts["kafka.sasl.mechanism"] = self.sasl_mechanism
            if self.sasl_username is not None:
                module = _JAAS_MODULES[self.sasl_mechanism]
                opts["kafka.sasl.jaas.config"] = (
                    f'{module} required username="{_jaas_quote(self.sasl_username)}" '
                    f'password="{_jaas_quote(self.sasl_password or "")}";'
                )
        if self.ssl_ca_location:
            opts["kafka.ssl.truststore.type"] = "PEM"
            opts["kafka.ssl.truststore.location"] = self.ssl_ca_location
        return opts

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        if not self.kafka_bootstrap or any(not part.strip() for part in self.kafka_bootstrap.split(",")):
            raise ConfigError(f"KAPPA_KAFKA_BOOTSTRAP: invalid bootstrap servers {self.kafka_bootstrap!r}")
        proto = self.security_protocol
        if proto is not None and proto not in SECURITY_PROTOCOLS:
            raise ConfigError(
                f"KAPPA_KAFKA_SECURITY_PROTOCOL: {proto!r} is not one of {', '.join(sorted(SECURITY_PROTOCOLS))}"
            )
        sasl = proto is not None and proto.startswith("SASL_")
        if sasl:
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError(
                    f"KAPPA_KAFKA_SASL_MECHANISM: {proto} needs one of {', '.join(sorted(SASL_MECHANISMS))}, "
                    f"got {self.sasl_mechanism!r}"
                )
            if not self.sasl_username or self.sasl_password is None:
                raise ConfigError(
                    f"KAPPA_KAFKA_SASL_USERNAME/KAPPA_KAFKA_SASL_PASSWORD: required with {proto}/{self.sasl_mechanism}"
                )
        elif self.sasl_mechanism or self.sasl_username:
            raise ConfigError(
                "KAPPA_KAFKA_SASL_*: SASL settings given but KAPPA_KAFKA_SECURITY_PROTOCOL is "
                f"{proto or 'unset'} (use SASL_PLAINTEXT or SASL_SSL)"
            )
        if self.ssl_ca_location and proto not in {"SSL", "SASL_SSL"}:
            raise ConfigError(
                f"KAPPA_KAFKA_SSL_CA_LOCATION: set but KAPPA_KAFKA_SECURITY_PROTOCOL is {proto or 'unset'} "
                "(use SSL or SASL_SSL)"
            )
