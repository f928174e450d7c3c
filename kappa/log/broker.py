"""A local single-node Apache Kafka broker in KRaft mode (combined broker + controller), for dev and tests.

The broker runs from the jars ``make setup`` put in ``.cache/jars/broker`` (no Kafka distribution, no
download at run time). Everything lives under one *home* directory:

.. code-block:: text

    <home>/server.properties   rewritten on every start (ports may change between runs)
    <home>/log4j2.properties   Log4j2 config: everything to logs/server.log
    <home>/cluster.id          KRaft cluster id, generated once; storage is formatted once with it
    <home>/data/               log.dirs (topic data + __cluster_metadata); survives stop/start
    <home>/logs/server.log     broker log;  logs/stdout.log: JVM stdout/stderr
    <home>/broker.pid          pid of the running broker

Single-node quorum: the controller is a *static* voter (``controller.quorum.voters=1@127.0.0.1:<cport>``),
so the storage is formatted with ``kafka.tools.StorageTool format -t <id> -c server.properties`` (no
``--standalone``: that is for dynamic quorums, which would pin the controller endpoint in the metadata log).

Example:
    >>> from pathlib import Path
    >>> from kappa.log.broker import LocalBroker
    >>> b = LocalBroker(Path("/tmp/kb"), port=19092, controller_port=19093)  # doctest: +SKIP
    >>> b.start()           # formats storage on first use, waits until an AdminClient sees the broker
    >>> b.bootstrap
    '127.0.0.1:19092'
    >>> b.stop()
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from kappa.config import Settings, jvm_size_bytes
from kappa.process import log_tails, owned_process, port_open, wait_exit
from kappa.errors import KappaError

__all__ = ["BrokerError", "LocalBroker", "default_broker", "free_port"]

_log = logging.getLogger(__name__)
_MAIN_CLASS = "kafka.Kafka"
_STORAGE_TOOL = "kafka.tools.StorageTool"
_MAX_HEAP = 1 << 30  # 1 GiB: the machine is shared


class BrokerError(KappaError, RuntimeError):
    """The local broker could not be started/stopped; the message carries the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free right now on ``host`` (for tests; racy by nature)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _new_cluster_id() -> str:
    # Kafka cluster ids are 16 random bytes, base64url without padding (22 chars); avoid a leading '-'
    # which command-line parsers would take for an option.
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


class LocalBroker:
    """A single-node KRaft Kafka broker (``process.roles=broker,controller``) bound to 127.0.0.1.

    Args:
        home: Directory holding config, data, logs and pid file (created on start).
        port: Client (PLAINTEXT) port.
        controller_port: KRaft controller port.
        heap: Max JVM heap (``-Xmx``), at most 1 GiB; ``-Xms`` is 256m (or less if heap is smaller).
        jars_dir: Folder of broker jars; default ``<repo>/.cache/jars/broker``.
        java: Java executable; default ``$JAVA_HOME/bin/java`` or ``java`` on PATH.
        startup_timeout: Seconds :meth:`start` waits for the broker to become usable.
        extra_config: Extra/overriding ``server.properties`` entries.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        home: Path,
        port: int = 9092,
        controller_port: int = 9093,
        heap: str = "768m",
        *,
        jars_dir: Path | None = None,
        java: str | None = None,
        startup_timeout: float = 90.0,
        extra_config: dict[str, str] | None = None,
    ) -> None:
        if port == controller_port:
            raise ValueError("port and controller_port must differ")
        heap_bytes = jvm_size_bytes(heap)
        if heap_bytes > _MAX_HEAP:
            raise ValueError(f"heap {heap!r} exceeds the 1 GiB limit of the local broker")
        if heap_bytes < 128 << 20:
            raise ValueError(f"heap {heap!r} is too small for a Kafka broker (>= 128m)")
        self.home = Path(home).resolve()
        self.port = int(port)
        self.controller_port = int(controller_port)
        self.heap = heap
        self._heap_bytes = heap_bytes
        self.jars_dir = Path(jars_dir) if jars_dir is not None else Settings.from_env().jars_dir / "broker"
        self.java = java or self._find_java()
        self.startup_timeout = startup_timeout
        self.extra_config = dict(extra_config or {})
        self._proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_settings(cls, settings: Settings | None = None, *, heap: str = "768m") -> LocalBroker:
        """The platform's default broker: home ``$KAPPA_HOME/broker``, port from ``kafka_bootstrap``.

        Raises:
            BrokerError: If the settings point at an external cluster (``KAPPA_KAFKA_BOOTSTRAP`` set).
        """
        s = settings or Settings.from_env()
        if not s.local_broker:
            raise BrokerError(
                f"KAPPA_KAFKA_BOOTSTRAP={s.kafka_bootstrap} points at an external cluster; "
                "the platform does not start a local broker"
            )
        port = int(s.kafka_bootstrap.rsplit(":", 1)[1])
        return cls(s.broker_home, port=port, controller_port=port + 1, heap=heap, jars_dir=s.jars_dir / "broker")

    @staticmethod
    def _find_java() -> str:
        java_home = os.environ.get("JAVA_HOME")
        if java_home and (Path(java_home) / "bin" / "java").exists():
            return str(Path(java_home) / "bin" / "java")
        found = shutil.which("java")
        if found is None:
            raise BrokerError("java not found on PATH (JDK >= 17 required; run `make setup` for the checks)")
        return found

    # ------------------------------------------------------------------ paths
    @property
    def bootstrap(self) -> str:
        """Bootstrap servers string for clients, ``127.0.0.1:<port>``."""
        return f"{self.host}:{self.port}"

    @property
    def data_dir(self) -> Path:
        """``log.dirs`` of the broker (topic data and the KRaft metadata log)."""
        return self.home / "data"

    @property
    def log_file(self) -> Path:
        """Main broker log (Log4j2)."""
        return self.home / "logs" / "server.log"

    @property
    def stdout_file(self) -> Path:
        """JVM stdout/stderr (startup failures before Log4j2 is up land here)."""
        return self.home / "logs" / "stdout.log"

    @property
    def pid_file(self) -> Path:
        """File holding the pid of the running broker."""
        return self.home / "broker.pid"

    @property
    def config_file(self) -> Path:
        """The generated ``server.properties``."""
        return self.home / "server.properties"

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int | None:
        """Pid of the running broker, or None."""
        proc = self._process()
        return proc.pid if proc is not None else None

    def is_running(self) -> bool:
        """True if this home's broker process is alive (not necessarily ready yet)."""
        return self._process() is not None

    def rss_bytes(self) -> int | None:
        """Resident set size of the broker JVM, or None if not running."""
        proc = self._process()
        if proc is None:
            return None
        with contextlib.suppress(psutil.Error):
            return int(proc.memory_info().rss)
        return None

    def log_tail(self, lines: int = 40) -> str:
        """Last ``lines`` lines of the broker log and of the JVM stdout (for error messages)."""
        return log_tails((self.log_file, self.stdout_file), lines) or f"(no log under {self.home / 'logs'})"

    def _process(self) -> psutil.Process | None:
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None  # reaped
        # guard against pid reuse: it must be *our* broker (same main class and config file)
        return owned_process(self.pid_file, lambda cmd: _MAIN_CLASS in cmd and str(self.config_file) in cmd)

    def _exited(self) -> str | None:
        """None while the broker runs; else what is known of its end (`` (exit code N)`` or empty).

        A broker this object started is asked through its own process handle: the pid file's guard reads the
        process' command line, and one read of it that failed while the JVM was starting once reported a live
        broker as gone (it went on running, orphaned, while every test that needed it errored)."""
        if self._proc is not None:
            code = self._proc.poll()
            return None if code is None else f" (exit code {code})"
        return None if self.is_running() else ""

    # ------------------------------------------------------------------ start
    def start(self, wait: bool = True, *, timeout: float | None = None) -> LocalBroker:
        """Start the broker (no-op if already running).

        Formats the storage on first use, launches the JVM detached (own session, own log files, pid
        file) and, with ``wait``, blocks until the port answers and an AdminClient sees the broker.

        Args:
            wait: Wait until the broker is usable.
            timeout: Seconds to wait (default: ``startup_timeout``).

        Returns:
            ``self``, for chaining.

        Raises:
            BrokerError: Jars missing, port taken, storage format failed, or the broker died / did not
                become ready in time (with the tail of its log).
        """
        if self.is_running():
            if wait:
                self.wait_ready(timeout=timeout)
            return self
        self._check_jars()
        for p in (self.port, self.controller_port):
            if port_open(self.host, p):
                raise BrokerError(
                    f"port {self.host}:{p} is already in use by another process (another broker? "
                    "stop it, choose other ports, or set KAPPA_KAFKA_BOOTSTRAP to use it as external cluster)"
                )
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._format_storage()

        cmd = [
            self.java, *self._jvm_opts(self._heap_bytes),
            "-cp", self._classpath(), _MAIN_CLASS, str(self.config_file),
        ]
        with open(self.stdout_file, "ab") as out:
            self._proc = subprocess.Popen(
                cmd,
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # detached: survives the CLI, not killed by the terminal's ^C
                close_fds=True,
            )
        self.pid_file.write_text(f"{self._proc.pid}\n")
        _log.info("broker pid %d starting at %s (home %s)", self._proc.pid, self.bootstrap, self.home)
        if wait:
            self.wait_ready(timeout=timeout)
        return self

    def wait_ready(self, *, timeout: float | None = None) -> None:
        """Block until the port answers and an AdminClient lists the broker.

        Raises:
            BrokerError: If the process exits or the deadline passes (with the tail of the log).
        """
        from confluent_kafka.admin import AdminClient  # local import: keep module import light

        deadline = time.monotonic() + (timeout if timeout is not None else self.startup_timeout)
        admin: AdminClient | None = None
        last_error = "port not open yet"
        while time.monotonic() < deadline:
            exited = self._exited()
            if exited is not None:
                raise BrokerError(f"broker process exited during startup{exited}\n{self.log_tail()}")
            if port_open(self.host, self.port):
                try:
                    if admin is None:
                        conf: dict[str, Any] = {
                            "bootstrap.servers": self.bootstrap, "socket.timeout.ms": 2000, "logger": _log,
                        }
                        admin = AdminClient(conf)
                    md = admin.list_topics(timeout=2)
                    if md.brokers:
                        return
                    last_error = "metadata has no brokers yet"
                except Exception as exc:  # confluent_kafka.KafkaException while starting up
                    last_error = str(exc)
            time.sleep(0.2)
        raise BrokerError(
            f"broker at {self.bootstrap} not ready after {timeout or self.startup_timeout:.0f}s "
            f"({last_error})\n{self.log_tail()}"
        )

    # ------------------------------------------------------------------ stop
    def stop(self, *, timeout: float = 30.0) -> bool:
        """Stop the broker: SIGTERM (controlled shutdown), then SIGKILL after ``timeout`` seconds.

        Returns:
            True if a running broker was stopped, False if it was not running.
        """
        proc = self._process()
        if proc is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)
        if not self._wait_exit(proc, timeout):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
            if not self._wait_exit(proc, 10.0):
                raise BrokerError(f"broker pid {proc.pid} did not die after SIGKILL")
        self.pid_file.unlink(missing_ok=True)
        _log.info("broker pid %d at %s stopped", proc.pid, self.bootstrap)
        return True

    def _wait_exit(self, proc: psutil.Process, timeout: float) -> bool:
        if not wait_exit(proc, self._proc, timeout):
            return False
        if self._proc is not None and self._proc.pid == proc.pid:
            self._proc = None  # reaped
        return True

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalBroker(home={str(self.home)!r}, bootstrap={self.bootstrap!r}, running={self.is_running()})"

    # ------------------------------------------------------------------ internals
    def _check_jars(self) -> None:
        if not self.jars_dir.is_dir() or not any(self.jars_dir.glob("kafka_*.jar")):
            raise BrokerError(f"no Kafka broker jars in {self.jars_dir} (run `make setup`)")

    def _classpath(self) -> str:
        return str(self.jars_dir / "*")

    def _jvm_opts(self, heap_bytes: int) -> list[str]:
        xms = min(heap_bytes, 256 << 20)
        return [
            f"-Xms{xms >> 20}m",
            f"-Xmx{heap_bytes >> 20}m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError",
            "-XX:MaxMetaspaceSize=256m",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={self.home / 'logs'}",
            f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}",
        ]

    def properties(self) -> dict[str, str]:
        """The ``server.properties`` entries this broker runs with."""
        h, p, c = self.host, self.port, self.controller_port
        props = {
            # KRaft, combined mode, single static voter
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{h}:{c}",
            "listeners": f"PLAINTEXT://{h}:{p},CONTROLLER://{h}:{c}",
            "advertised.listeners": f"PLAINTEXT://{h}:{p}",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            # single node: every internal topic with RF 1, small partition counts (2 shared cores)
            "num.partitions": "1",
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "delete.topic.enable": "true",
            # topics declare their own retention; check often so short-retention tests don't wait 5 min
            "log.retention.check.interval.ms": "5000",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "background.threads": "4",
            "num.recovery.threads.per.data.dir": "1",
        }
        props.update(self.extra_config)
        return props

    def _write_config(self) -> None:
        lines = ["# generated by kappa.log.broker.LocalBroker -- rewritten on every start"]
        lines += [f"{k}={v}" for k, v in self.properties().items()]
        self.config_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
        (self.home / "log4j2.properties").write_text(_LOG4J2, encoding="utf-8")

    def _cluster_id(self) -> str:
        f = self.home / "cluster.id"
        if f.exists():
            return f.read_text().strip()
        cid = _new_cluster_id()
        f.write_text(cid + "\n")
        return cid

    def _format_storage(self) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
        cmd = [
            self.java, "-Xmx256m", f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.home / 'logs'}",
            "-cp", self._classpath(), _STORAGE_TOOL,
            "format", "-t", self._cluster_id(), "-c", str(self.config_file),
        ]
        res = subprocess.run(cmd, cwd=self.home, capture_output=True, text=True, timeout=120, check=False)
        if res.returncode != 0:
            raise BrokerError(
                f"formatting KRaft storage in {self.data_dir} failed (exit {res.returncode}):\n"
                f"{(res.stdout + res.stderr).strip()[-4000:]}"
            )


def default_broker(settings: Settings | None = None) -> LocalBroker:
    """The platform's local broker for ``settings`` (see :meth:`LocalBroker.from_settings`)."""
    return LocalBroker.from_settings(settings)


_LOG4J2 = """\
# generated by kappa.log.broker.LocalBroker
status = warn
shutdownHook = disable
name = kappa-broker
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.filePattern = ${sys:kafka.logs.dir}/server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = info
logger.apache.name = org.apache.kafka
logger.apache.level = info
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.channel.name = kafka.network.RequestChannel$
logger.channel.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
"""
