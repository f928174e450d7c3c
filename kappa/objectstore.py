"""A local S3-API object store (SeaweedFS: its S3 gateway, filer, master and a volume server), for dev and tests.

The store runs the pinned ``weed`` binary ``infra/objectstore/build.sh`` builds from the Go module proxy into the
tools cache (``SEAWEEDFS_VERSION`` in ``infra/versions.env``), as two processes: ``weed server`` (master, filer and
S3 gateway) and ``weed volume`` (the object contents). Every listener is bound to 127.0.0.1 on ports of its own
choosing (:class:`Ports`: an HTTP and a gRPC port for each of the four servers), so two stores and a running
``make run`` never collide; the master's telemetry is off. Pods of a cluster on this machine reach the lake when the
S3 gateway alone also listens on an address they can route to (``s3_bind``, ``KAPPA_OBJECTSTORE_S3_BIND``,
``make objectstore-up S3_BIND=0.0.0.0``): the gateway refuses every unsigned request; the master, filer and volume
server, which do not check credentials, stay on loopback. Requests are signed (AWS Signature V4) with a credential
of the store's own, generated once; a request signed with anything else is refused (403). Everything lives under
one *home* directory:

.. code-block:: text

    <home>/credentials.json   the platform's access key id + secret key, and a read-only one (analysts), each
                              generated once (mode 0600)
    <home>/s3.json            weed's -s3.config identities (the two credentials), rewritten on every start (0600)
    <home>/data/              the server's -dir: master metadata and the filer's store (names, metadata)
    <home>/volumes/           the volume server's -dir: object contents; both folders survive stop/start
    <home>/logs/server.log    the server's log;  logs/volume.log: the volume server's
    <home>/server.pid         pids of the running processes;  volume.pid

Besides the buckets its users create, the store holds ``objectstore-ready``: :meth:`LocalObjectStore.wait_ready`
writes a probe object there on every start (a store takes writes some seconds after it answers reads).

Why two processes: a stopping ``weed server`` runs its shutdown hooks in a fixed order, its volume server before its
filer, whose last flush of the metadata log then finds no volume and retries for 15 s before dropping it. With the
volume server a process of its own, :meth:`LocalObjectStore.stop` stops the server first (its filer flushes to the
still running volume server) and the volume server after it: a clean stop in about a second.

The store honours S3 conditional writes (``PUT`` with ``If-None-Match: *`` onto an existing key is refused with 412),
which is what delta-rs commits with: :meth:`LocalObjectStore.delta_rs_options` needs no lock service.
:meth:`LocalObjectStore.spark_conf` is the same store for Spark's ``s3a`` file system.

``python -m kappa.objectstore up|down|status`` (``make objectstore-up`` / ``make objectstore-down``) runs the
platform's store: home ``$KAPPA_HOME/objectstore``, S3 on 127.0.0.1:8333 (:data:`DEFAULT_PORTS`), bucket ``kappa``.

Example:
    >>> from pathlib import Path
    >>> from kappa.objectstore import LocalObjectStore, Ports
    >>> s = LocalObjectStore(Path("/tmp/os"), ports=Ports.free())  # doctest: +SKIP
    >>> s.start()                  # returns once the store takes writes (wait_ready)
    >>> s.ensure_bucket("kappa")
    's3://kappa'
    >>> write_deltalake("s3://kappa/t", data, storage_options=s.delta_rs_options())  # doctest: +SKIP
    >>> s.stop()
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import psutil

from kappa.config import Settings, aws_endpoint, default_repo_root
from kappa.errors import KappaError, one_line
from kappa.process import log_tails, owned_process, port_open, wait_exit

__all__ = ["DEFAULT_BUCKET", "DEFAULT_PORTS", "DEFAULT_REGION", "PROBE_BUCKET", "LocalObjectStore", "ObjectStoreError",
           "Ports", "main", "on_platform_store", "use_platform_store", "weed_binary"]

_log = logging.getLogger(__name__)

#: Free space under which a store that does not come up says how little there is.
LOW_DISK_BYTES = 10 * 2**30
#: Free disk space under which the local store's volumes turn read-only (see ``LocalObjectStore(min_free_space=)``).
MIN_FREE_SPACE = "512MiB"
#: The platform's bucket (``make objectstore-up`` creates it).
DEFAULT_BUCKET = "kappa"
#: The bucket :meth:`LocalObjectStore.wait_ready` writes its probe object to (``probe``) on every start.
PROBE_BUCKET = "objectstore-ready"
#: Where the platform's store's S3 gateway listens besides loopback (an IP address, 0.0.0.0 for every one).
S3_BIND_VAR = "KAPPA_OBJECTSTORE_S3_BIND"
#: The region clients sign for (the store accepts any; SigV4 needs one).
DEFAULT_REGION = "us-east-1"
_SERVICE = "s3"
_ALGORITHM = "AWS4-HMAC-SHA256"
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class ObjectStoreError(KappaError, RuntimeError):
    """The local object store could not be built, started, stopped or asked; a failed start carries its log tail."""


def _ephemeral_low() -> int:
    """First port of the kernel's ephemeral (outgoing connection) range; Linux's default when unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclasses.dataclass(frozen=True, slots=True)
class Ports:
    """The store's listening ports on 127.0.0.1: an HTTP and a gRPC port for each of its four servers."""

    s3: int
    master: int
    volume: int
    filer: int
    s3_grpc: int
    master_grpc: int
    volume_grpc: int
    filer_grpc: int

    def __post_init__(self) -> None:
        values = dataclasses.astuple(self)
        if len(set(values)) != len(values):
            raise ValueError(f"the object store's ports must differ: {self}")
        if not all(0 < p < 65536 for p in values):
            raise ValueError(f"the object store's ports must be in 1..65535: {self}")

    @classmethod
    def from_base(cls, s3: int = 8333, master: int = 9333, volume: int = 8334, filer: int = 8888) -> Ports:
        """HTTP ports as given, each gRPC port 10000 above its HTTP port (weed's own convention)."""
        return cls(s3, master, volume, filer, s3 + 10000, master + 10000, volume + 10000, filer + 10000)

    @classmethod
    def free(cls, host: str = "127.0.0.1") -> Ports:
        """Eight distinct ports that are free right now on ``host`` (for tests; racy by nature), below the kernel's
        ephemeral range: the store keeps its ports across a stop and a restart, and a port in that range can be
        taken meanwhile as the local end of any process's outgoing connection (the restart then fails to bind)."""
        import random

        below = _ephemeral_low()
        candidates = random.sample(range(max(1024, below - 8000), below), 400)
        socks: list[socket.socket] = []
        try:
            for port in candidates:  # held open together until eight are found
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
                if len(socks) == 8:
                    return cls(*(int(s.getsockname()[1]) for s in socks))
            raise ObjectStoreError(f"no eight free ports on {host} in {max(1024, below - 8000)}..{below - 1}")
        finally:
            for s in socks:
                s.close()

    def items(self) -> list[tuple[str, int]]:
        """``(name, port)`` pairs, HTTP ports first."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]


#: The platform's store (``make objectstore-up``): S3 on the conventional 8333; the volume server off weed's 8080,
#: which is the local Airflow's port.
DEFAULT_PORTS = Ports.from_base()


def weed_binary(*, build: bool = False, repo_root: Path | None = None) -> Path:
    """The pinned ``weed`` binary in the tools cache, as ``infra/objectstore/build.sh`` names it.

    Args:
        build: Build it when missing (minutes, once per machine); otherwise only look.
        repo_root: The repository holding ``infra/``; default the one of this package.

    Raises:
        ObjectStoreError: The build script is missing or failed, or (without ``build``) the binary is not built.
    """
    root = repo_root or default_repo_root()
    script = root / "infra" / "objectstore" / "build.sh"
    if not script.exists():
        raise ObjectStoreError(f"{script} not found (the object store is built from a checkout of the repository)")
    env = dict(os.environ)
    if not build:
        env["KAPPA_OBJECTSTORE_NO_BUILD"] = "1"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise ObjectStoreError(f"infra/objectstore/build.sh failed (exit {proc.returncode})\n{tail}")
    weed = Path(proc.stdout.strip().splitlines()[-1]) / "weed"
    if not os.access(weed, os.X_OK):
        raise ObjectStoreError(f"{weed} is not built (run `make objectstore-up` or infra/objectstore/build.sh)")
    return weed


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (created 0600, never readable by others)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode("utf-8"), hashlib.sha256).digest()


#: The store's two processes, in the order they stop: the server's filer flushes to the volume server on its way out.
_ROLES = ("server", "volume")


class LocalObjectStore:
    """SeaweedFS with its S3 gateway, every listener on 127.0.0.1, everything under ``home``.

    Args:
        home: Directory holding credentials, data, logs and pid files (created on first use).
        ports: Its listening ports; default :data:`DEFAULT_PORTS` (tests pass :meth:`Ports.free`).
        weed: The ``weed`` binary; default the pinned one in the tools cache (:func:`weed_binary`, no build).
        region: The region clients sign for.
        startup_timeout: Seconds :meth:`start` waits for the store to become usable.
        volume_size_limit_mb: Size at which a volume stops taking writes (a volume is one file of object contents).
        max_volumes: Most volumes the volume server keeps; 0: as many as the free disk space holds.
        min_free_space: Free disk space under which the volume server marks its volumes read-only (SeaweedFS'
            ``-minFreeSpace``: a percentage when <= 100, else a size such as ``512MiB``). SeaweedFS' own default,
            1 %, is 2.5 GiB of a 250 GiB disk shared with other work: a local store refused writes, and did not
            come up, while gigabytes were still free; the default here is :data:`MIN_FREE_SPACE`.
        s3_bind: An address the S3 gateway listens on instead of 127.0.0.1, for clients elsewhere (pods): an IP
            address of this machine, or ``0.0.0.0`` for all of them (loopback included). The other servers stay on
            127.0.0.1. Empty (default): loopback only.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        home: Path,
        *,
        ports: Ports | None = None,
        weed: Path | None = None,
        region: str = DEFAULT_REGION,
        startup_timeout: float = 60.0,
        volume_size_limit_mb: int = 64,
        max_volumes: int = 0,
        min_free_space: str = "",
        s3_bind: str = "",
    ) -> None:
        self.home = Path(home).resolve()
        try:
            self.s3_bind = str(ipaddress.IPv4Address(s3_bind)) if s3_bind else ""
        except ValueError:
            raise ObjectStoreError(f"s3_bind {s3_bind!r} is not an IPv4 address (e.g. 0.0.0.0 or this machine's "
                                   "address on the pods' network)") from None
        self.ports = ports or DEFAULT_PORTS
        self._weed = Path(weed) if weed is not None else None
        self.region = region
        self.startup_timeout = startup_timeout
        self.volume_size_limit_mb = int(volume_size_limit_mb)
        self.max_volumes = int(max_volumes)
        self.min_free_space = min_free_space or MIN_FREE_SPACE
        #: Seconds the last :meth:`start` took until the store was usable (None before one).
        self.last_start_seconds: float | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        #: Exit codes of processes the last :meth:`start` launched that have exited since (reaped here).
        self._exit_codes: dict[str, int] = {}

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> LocalObjectStore:
        """The platform's store: home ``$KAPPA_HOME/objectstore``, :data:`DEFAULT_PORTS`, the S3 gateway also on
        ``$KAPPA_OBJECTSTORE_S3_BIND`` when set."""
        s = settings or Settings.from_env()
        return cls(s.home / "objectstore", s3_bind=os.environ.get(S3_BIND_VAR, ""))

    # ------------------------------------------------------------------ paths
    @property
    def weed(self) -> Path:
        """The ``weed`` binary this store runs."""
        if self._weed is None:
            self._weed = weed_binary()
        return self._weed

    @property
    def endpoint(self) -> str:
        """The S3 endpoint this machine's clients use, ``http://<s3_host>:<s3 port>`` (127.0.0.1 unless ``s3_bind``
        names one address)."""
        return f"http://{self.s3_host}:{self.ports.s3}"

    @property
    def s3_host(self) -> str:
        """The address the S3 gateway answers on from this machine: 127.0.0.1, or ``s3_bind`` when that names one
        address (an explicit bind has SeaweedFS drop its loopback listener)."""
        return self.s3_bind if self.s3_bind not in ("", "0.0.0.0") else self.host

    @property
    def data_dir(self) -> Path:
        """The server's ``-dir``: master metadata and the filer's store."""
        return self.home / "data"

    @property
    def volumes_dir(self) -> Path:
        """The volume server's ``-dir``: object contents."""
        return self.home / "volumes"

    def log_file(self, role: str = "server") -> Path:
        """The log of process ``role`` (``server`` or ``volume``): its stdout and stderr."""
        return self.home / "logs" / f"{role}.log"

    def pid_file(self, role: str = "server") -> Path:
        """File holding the pid of process ``role`` while it runs."""
        return self.home / f"{role}.pid"

    @property
    def credentials_file(self) -> Path:
        """The store's credential (mode 0600)."""
        return self.home / "credentials.json"

    @property
    def s3_config_file(self) -> Path:
        """weed's ``-s3.config`` (mode 0600)."""
        return self.home / "s3.json"

    # ------------------------------------------------------------------ credentials and client settings
    def credentials(self) -> tuple[str, str]:
        """``(access key id, secret key)`` of the store (read, list, write, admin), generated on first use and kept
        under the home."""
        return self._credential("")

    def reader_credentials(self) -> tuple[str, str]:
        """``(access key id, secret key)`` that may only read and list (``Read``, ``List``): what an analyst is
        given to read the lake's files; generated on first use, known to the store from its next start."""
        return self._credential("reader_")

    def _credential(self, prefix: str) -> tuple[str, str]:
        data: dict[str, str] = {}
        try:
            data = json.loads(self.credentials_file.read_text(encoding="utf-8"))
            if prefix + "access_key_id" in data:
                return str(data[prefix + "access_key_id"]), str(data[prefix + "secret_access_key"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ObjectStoreError(f"unreadable credentials in {self.credentials_file}: {exc}") from exc
        alphabet = string.ascii_uppercase + string.digits
        access = ("KAPPAR" if prefix else "KAPPA") + "".join(secrets.choice(alphabet) for _ in range(15))
        secret = secrets.token_urlsafe(30)  # 40 characters
        data.update({prefix + "access_key_id": access, prefix + "secret_access_key": secret})
        self.home.mkdir(parents=True, exist_ok=True)
        _write_private(self.credentials_file, json.dumps(data, indent=2) + "\n")
        return access, secret

    def reader_env(self) -> dict[str, str]:
        """The environment of a read-only client of this store (delta-rs, DuckDB, the AWS CLI read ``AWS_*``)."""
        access, secret = self.reader_credentials()
        return {**self.delta_rs_options(), "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret}

    @property
    def access_key_id(self) -> str:
        return self.credentials()[0]

    @property
    def secret_access_key(self) -> str:
        return self.credentials()[1]

    def delta_rs_options(self) -> dict[str, str]:
        """delta-rs (``deltalake``) storage options for ``s3://<bucket>/...`` tables on this store.

        Commits are conditional writes (``If-None-Match``), which the store honours: no locking provider is set (a
        DynamoDB one is gone from delta-rs and would make the client behave as on real AWS).
        """
        access, secret = self.credentials()
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": access,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    def spark_conf(self) -> dict[str, str]:
        """Spark settings of Hadoop's ``s3a`` file system for ``s3a://<bucket>/...`` paths on this store."""
        access, secret = self.credentials()
        p = "spark.hadoop.fs.s3a."
        return {
            p + "endpoint": self.endpoint,
            p + "endpoint.region": self.region,
            p + "path.style.access": "true",
            p + "connection.ssl.enabled": "false",
            p + "access.key": access,
            p + "secret.key": secret,
            p + "aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
        }

    # ------------------------------------------------------------------ S3 requests
    def request(
        self,
        method: str,
        bucket: str = "",
        key: str = "",
        *,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        query: Mapping[str, str] | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        timeout: float = 10.0,
        address: str | None = None,
    ) -> Any:
        """One S3 request, signed with AWS Signature V4 (path style); returns the ``requests.Response``.

        ``access_key_id`` / ``secret_access_key`` override the store's credential (a refused request in tests);
        ``address`` is the IP address to send it to (default 127.0.0.1; another one with ``s3_bind``).
        """
        import requests  # local import: keep module import light

        access, secret = self.credentials()
        access = access_key_id or access
        secret = secret_access_key or secret
        parts = ([bucket] if bucket else []) + (key.split("/") if key else [])
        path = "/" + "/".join(quote(part, safe="-_.~") for part in parts)
        canonical_query = "&".join(
            f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted((query or {}).items()))
        now = dt.datetime.now(dt.UTC)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        payload_hash = hashlib.sha256(body).hexdigest()
        signed = {k.lower(): str(v).strip() for k, v in (headers or {}).items()}
        host = f"{address or self.s3_host}:{self.ports.s3}"
        signed.update({"host": host, "x-amz-date": amz_date,
                       "x-amz-content-sha256": payload_hash})
        names = sorted(signed)
        canonical_request = "\n".join([
            method.upper(), path, canonical_query, "".join(f"{n}:{signed[n]}\n" for n in names), ";".join(names),
            payload_hash,
        ])
        scope = f"{day}/{self.region}/{_SERVICE}/aws4_request"
        to_sign = "\n".join([_ALGORITHM, amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest()])
        key_bytes = _hmac(_hmac(_hmac(_hmac(("AWS4" + secret).encode(), day), self.region), _SERVICE), "aws4_request")
        signature = hmac.new(key_bytes, to_sign.encode(), hashlib.sha256).hexdigest()
        signed["authorization"] = (f"{_ALGORITHM} Credential={access}/{scope}, SignedHeaders={';'.join(names)}, "
                                   f"Signature={signature}")
        url = f"http://{host}" + path + (f"?{canonical_query}" if canonical_query else "")
        return requests.request(method.upper(), url, data=body or None, headers=signed, timeout=timeout)

    def ensure_bucket(self, name: str = DEFAULT_BUCKET) -> str:
        """Create bucket ``name`` unless it exists; returns ``s3://<name>``.

        Raises:
            ObjectStoreError: The name is not a valid bucket name or the store refused.
        """
        if not _BUCKET_NAME.fullmatch(name) or ".." in name:
            raise ObjectStoreError(f"{name!r} is not a valid bucket name (3-63 of a-z, 0-9, '.', '-')")
        resp = self.request("PUT", name)
        if resp.status_code == 200 or (resp.status_code == 409 and "BucketAlreadyOwnedByYou" in resp.text):
            return f"s3://{name}"
        raise ObjectStoreError(f"creating bucket {name} at {self.endpoint}: HTTP {resp.status_code} "
                               f"{one_line(resp.text) or resp.reason}")

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int | None:
        """Pid of the running server process (master, filer, S3), or None."""
        proc = self._process("server")
        return proc.pid if proc is not None else None

    def pids(self) -> dict[str, int]:
        """Pids of the store's running processes, by role (``server``, ``volume``)."""
        return {role: proc.pid for role in _ROLES if (proc := self._process(role)) is not None}

    def is_running(self) -> bool:
        """True if both processes of this home's store are alive (not necessarily ready yet)."""
        return len(self.pids()) == len(_ROLES)

    def rss_bytes(self) -> int | None:
        """Resident set size of the store (both processes), or None if not running."""
        total = 0
        for role in _ROLES:
            proc = self._process(role)
            if proc is None:
                return None
            try:
                total += int(proc.memory_info().rss)
            except psutil.Error:
                return None
        return total

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of each process' log (for error messages)."""
        return (log_tails((self.log_file(role) for role in _ROLES), lines)
                or f"(no log under {self.home / 'logs'})")

    def _process(self, role: str) -> psutil.Process | None:
        own = self._procs.get(role)
        if own is not None and own.poll() is not None:
            self._exit_codes[role] = own.returncode
            del self._procs[role]  # reaped
        # guard against pid reuse: it must be *our* process (weed <role> on this home's folder)
        folder = self.data_dir if role == "server" else self.volumes_dir
        return owned_process(self.pid_file(role), lambda cmd: role in cmd and f"-dir={folder}" in cmd)

    # ------------------------------------------------------------------ start
    def command(self, role: str) -> list[str]:
        """The command line of process ``role``: ``server`` (master, filer, S3) or ``volume``."""
        p, h = self.ports, self.host
        common = [str(self.weed), "-logtostderr=true", role, f"-ip={h}", f"-ip.bind={h}"]
        if role == "volume":
            return common + [
                f"-dir={self.volumes_dir}", f"-master={h}:{p.master}.{p.master_grpc}",
                f"-port={p.volume}", f"-port.grpc={p.volume_grpc}", f"-max={self.max_volumes}",
                f"-minFreeSpace={self.min_free_space}",
                "-preStopSeconds=0",  # no load balancer to drain: stop at once
            ]
        return common + [
            f"-dir={self.data_dir}", "-volume=false",
            f"-master.port={p.master}", f"-master.port.grpc={p.master_grpc}",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}", "-master.telemetry=false",
            "-master.electionTimeout=1s",  # a single master: its election on a restart takes ~2 s, not ~20
            "-filer", f"-filer.port={p.filer}", f"-filer.port.grpc={p.filer_grpc}",
            "-s3", f"-s3.port={p.s3}", f"-s3.port.grpc={p.s3_grpc}", f"-s3.config={self.s3_config_file}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ] + ([f"-s3.ip.bind={self.s3_bind}"] if self.s3_bind else [])

    def running_s3_bind(self) -> str | None:
        """The address the running server's S3 gateway was started with besides loopback ("" for none); None when
        the store is not running."""
        proc = self._process("server")
        if proc is None:
            return None
        with contextlib.suppress(psutil.Error):
            for arg in proc.cmdline():
                if arg.startswith("-s3.ip.bind="):
                    return arg.split("=", 1)[1]
        return ""

    def start(self, wait: bool = True, *, timeout: float | None = None) -> LocalObjectStore:
        """Start the store (no-op if it runs already; a half store, one process gone, is stopped and started anew).

        Writes the identities file, launches both processes detached (own session, log file, pid file) and, with
        ``wait``, blocks until the store is usable (:meth:`wait_ready`).

        Returns:
            ``self``, for chaining.

        Raises:
            ObjectStoreError: Binary missing, a port taken, or a process died / the store did not become ready in
                time (with the tail of the logs).
        """
        if self.is_running():
            if wait:
                self.wait_ready(timeout=timeout)
            return self
        if self.pids():
            _log.warning("object store at %s runs only in part (%s); restarting it", self.endpoint, self.pids())
            self.stop()
        weed = self.weed
        if not os.access(weed, os.X_OK):
            raise ObjectStoreError(f"{weed} is not an executable (run infra/objectstore/build.sh)")
        for name, port in self.ports.items():
            if port_open(addr := self.s3_host if name == "s3" else self.host, port):
                raise ObjectStoreError(
                    f"port {addr}:{port} ({name}) is already in use by another process "
                    "(another object store? stop it or choose other ports)")
        for folder in (self.home / "logs", self.data_dir, self.volumes_dir):
            folder.mkdir(parents=True, exist_ok=True)
        access, secret = self.credentials()
        reader, reader_secret = self.reader_credentials()
        identities = {"identities": [{
            "name": "kappa",
            "credentials": [{"accessKey": access, "secretKey": secret}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }, {
            "name": "analyst",  # read-only: every write, delete or tagging is refused (403)
            "credentials": [{"accessKey": reader, "secretKey": reader_secret}],
            "actions": ["Read", "List"],
        }]}
        _write_private(self.s3_config_file, json.dumps(identities, indent=2) + "\n")
        # the master holds the first volume allocation of a new cluster back (15 s) for veteran volume servers of a
        # rebuilt master to report; this store's only volume server comes with it: no hold (a write waits otherwise)
        env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_ALLOCATION_DEFERRAL": "0s"}
        started = time.monotonic()
        self._exit_codes = {}
        for role in _ROLES:
            with open(self.log_file(role), "ab") as out:
                proc = subprocess.Popen(
                    self.command(role),
                    cwd=self.home,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # detached: survives the CLI, not killed by the terminal's ^C
                    close_fds=True,
                )
            self._procs[role] = proc
            self.pid_file(role).write_text(f"{proc.pid}\n")
        _log.info("object store starting at %s (pids %s, home %s)", self.endpoint, self.pids(), self.home)
        if wait:
            self.wait_ready(timeout=timeout)
            self.last_start_seconds = time.monotonic() - started
        return self

    def wait_ready(self, *, timeout: float | None = None) -> None:
        """Block until the store takes writes: the S3 endpoint answers a signed request, the volume server is
        registered with the master and a probe object can be written to bucket :data:`PROBE_BUCKET`.

        The probe is what a client's first write would otherwise wait for. A new store takes writes ~10 s after its
        start: S3 writes take a lock from the filer's lock ring, which forms once the filer joined the cluster, and
        the filer first waits some seconds for peers that may hold metadata. A store started on existing data takes
        ~17 s: its master refuses new file ids for 15 s after electing itself (three heartbeat pulses for volume
        servers to report what they hold).

        Raises:
            ObjectStoreError: If a process exits or the deadline passes (with the tail of the logs).
        """
        import requests

        limit = timeout if timeout is not None else self.startup_timeout
        deadline = time.monotonic() + limit
        last_error = "S3 port not open yet"
        while time.monotonic() < deadline:
            if not self.is_running():
                # the processes this object started are the ground truth while they run (a check of a pid file
                # and a command line is not); one of them reaped (is_running polled them), or none started here
                if self._exit_codes or not self._procs:
                    codes = ", ".join(f"{role} exit code {code}" for role, code in self._exit_codes.items())
                    raise ObjectStoreError(f"object store process exited during startup{f' ({codes})' if codes else ''}"
                                           f"{self._low_disk()}; see {self.home / 'logs'}\n{self.log_tail()}")
            if port_open(self.s3_host, self.ports.s3):
                try:
                    last_error = self._not_ready(requests, max(0.5, min(5.0, deadline - time.monotonic())))
                    if last_error is None:
                        return
                except (OSError, ValueError) as exc:  # requests' errors are OSErrors; a bad JSON a ValueError
                    last_error = one_line(exc)
            time.sleep(0.2)
        raise ObjectStoreError(f"object store at {self.endpoint} not ready after {limit:.0f}s ({last_error})"
                               f"{self._low_disk()}; see {self.home / 'logs'}\n{self.log_tail()}")

    def _low_disk(self) -> str:
        """`` - only N GiB free on the disk of <home>`` when under :data:`LOW_DISK_BYTES` (a volume server on a
        nearly full disk is a common reason a store does not come up), else empty."""
        try:
            free = shutil.disk_usage(self.home).free
        except OSError:
            return ""
        return f" - only {free / 2**30:.1f} GiB free on the disk of {self.home}" if free < LOW_DISK_BYTES else ""

    def _not_ready(self, requests: Any, timeout: float) -> str | None:
        """What keeps the store from taking writes right now, or None when nothing does."""
        resp = self.request("GET", timeout=timeout)
        if resp.status_code != 200:
            return f"S3 answers HTTP {resp.status_code} {one_line(resp.text) or resp.reason}"
        topology = requests.get(f"http://{self.host}:{self.ports.master}/dir/status",
                                timeout=timeout).json().get("Topology") or {}
        if int(topology.get("Max") or 0) <= 0:
            return "the volume server is not registered with the master yet"
        resp = self.request("PUT", PROBE_BUCKET, timeout=timeout)
        if resp.status_code not in (200, 409):
            return f"creating bucket {PROBE_BUCKET}: HTTP {resp.status_code} {one_line(resp.text) or resp.reason}"
        resp = self.request("PUT", PROBE_BUCKET, "probe", body=b"ready\n", timeout=timeout)
        if resp.status_code != 200:
            return f"a probe write: HTTP {resp.status_code} {one_line(resp.text) or resp.reason}"
        return None

    # ------------------------------------------------------------------ stop
    def stop(self, *, timeout: float = 30.0) -> bool:
        """Stop the store: SIGTERM to the server, then to the volume server (SIGKILL if one outlives ``timeout``).

        Returns:
            True if a process of the store ran, False if none did.
        """
        stopped = False
        for role in _ROLES:  # the server first: its filer flushes its metadata log to the volume server
            proc = self._process(role)
            if proc is None:
                continue
            stopped = True
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)
            if not self._wait_exit(role, proc, timeout):
                _log.warning("object store %s pid %d did not stop in %.0f s; killing it", role, proc.pid, timeout)
                self._kill(role, proc)
        self._cleanup()
        if stopped:
            _log.info("object store at %s stopped", self.endpoint)
        return stopped

    def kill(self) -> bool:
        """SIGKILL both processes (a crash, for fault tests). Returns False if none ran."""
        procs = {role: proc for role in _ROLES if (proc := self._process(role)) is not None}
        for role, proc in procs.items():
            self._kill(role, proc)
        self._cleanup()
        return bool(procs)

    def restart(self, *, wait: bool = True) -> LocalObjectStore:
        """Stop the store if it runs, then start it again (same ports, same data)."""
        self.stop()
        return self.start(wait=wait)

    def _kill(self, role: str, proc: psutil.Process) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
        if not self._wait_exit(role, proc, 10.0):
            raise ObjectStoreError(f"object store {role} pid {proc.pid} did not die after SIGKILL")

    def _cleanup(self) -> None:
        for role in _ROLES:
            self.pid_file(role).unlink(missing_ok=True)
        # the server's local sockets, named after their ports under /tmp; the process that owned them is gone
        p = self.ports
        for name in (f"seaweedfs-filer-{p.filer}.sock", f"seaweedfs-s3-{p.s3}.sock",
                     f"seaweedfs-master-grpc-{p.master_grpc}.sock", f"seaweedfs-filer-grpc-{p.filer_grpc}.sock",
                     f"seaweedfs-s3-grpc-{p.s3_grpc}.sock"):
            with contextlib.suppress(OSError):
                (Path("/tmp") / name).unlink(missing_ok=True)

    def _wait_exit(self, role: str, proc: psutil.Process, timeout: float) -> bool:
        own = self._procs.get(role)
        if not wait_exit(proc, own, timeout):
            return False
        if own is not None and own.pid == proc.pid:
            del self._procs[role]  # reaped
        return True

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> LocalObjectStore:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalObjectStore(home={str(self.home)!r}, endpoint={self.endpoint!r}, running={self.is_running()})"


# ---------------------------------------------------------------------- command line
#: Set by :func:`use_platform_store` to the home whose store the AWS variables of the environment name.
PLATFORM_STORE_VAR = "KAPPA_PLATFORM_OBJECT_STORE"


def on_platform_store(settings: Settings, env: Mapping[str, str] | None = None) -> bool:
    """Whether the lake is on the platform's own store: an ``s3a://``/``s3://`` lake and no other store named in the
    environment (``AWS_ENDPOINT_URL[_S3]``, unless :func:`use_platform_store` put it there; with another, the lake is
    on that store and the environment carries its credentials)."""
    env = os.environ if env is None else env
    if not settings.lake_uri.startswith(("s3a://", "s3://")):
        return False
    return (env.get(PLATFORM_STORE_VAR) == str(settings.home)  # set by use_platform_store (here or in a parent)
            or not aws_endpoint(env))


def use_platform_store(settings: Settings, *, start: bool = False) -> LocalObjectStore | None:
    """For a lake on the platform's store (:func:`on_platform_store`): put the store's endpoint and credential into
    this process's environment - every reader and writer of the lake (delta-rs, obstore, Spark's s3a) and every
    child process takes them from there - starting the store and creating the lake's bucket first with ``start``.
    Returns the store, or None when the lake is elsewhere or (without ``start``) the store is not running."""
    if not on_platform_store(settings):
        return None
    store = LocalObjectStore.from_settings(settings)
    if start:
        if not store.is_running():
            try:
                store.start()
            except ObjectStoreError:
                store.stop()  # nothing half-started left behind
                raise
        store.ensure_bucket(settings.lake_uri.split("://", 1)[1].split("/", 1)[0])
    elif not store.is_running():
        return None
    os.environ.update(store.delta_rs_options())
    os.environ[PLATFORM_STORE_VAR] = str(settings.home)
    return store


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ObjectStoreError(f"{message} (usage: python -m kappa.objectstore up [--s3-bind ADDRESS]|down|status)")


def _pids(store: LocalObjectStore) -> str:
    return ", ".join(f"{role} {pid}" for role, pid in store.pids().items())


def main(argv: list[str] | None = None) -> int:
    """``python -m kappa.objectstore up|down|status|reader-env|secret-env``: the platform's store under
    ``$KAPPA_HOME/objectstore``; ``reader-env`` prints the ``export`` lines of its read-only credential,
    ``secret-env`` its platform credential as ``KEY=VALUE`` lines (``kubectl create secret generic
    --from-env-file``: the lake's Secret of pods, ``lake.s3.existingSecret``).
    ``up --s3-bind ADDRESS`` (or ``$KAPPA_OBJECTSTORE_S3_BIND``) has its S3 gateway listen there too (pods)."""
    parser = _Parser(prog="python -m kappa.objectstore", description="the platform's local S3-API object store")
    parser.add_argument("command", choices=["up", "down", "status", "reader-env", "secret-env"])
    parser.add_argument("--s3-bind", default=None, metavar="ADDRESS",
                        help="up: the S3 gateway also listens on this IPv4 address (0.0.0.0: all of them)")
    try:
        args = parser.parse_args(argv)
        store = LocalObjectStore.from_settings()
        if args.s3_bind is not None:
            store = LocalObjectStore(store.home, s3_bind=args.s3_bind)
        if args.command == "reader-env":
            print("".join(f"export {k}={shlex.quote(v)}\n" for k, v in store.reader_env().items()), end="")
            return 0
        if args.command == "secret-env":
            key_id, secret = store.credentials()
            print(f"AWS_ACCESS_KEY_ID={key_id}\nAWS_SECRET_ACCESS_KEY={secret}")
            return 0
        if args.command == "up":
            was_running = store.is_running()
            if was_running and (bound := store.running_s3_bind()) != store.s3_bind:
                raise ObjectStoreError(
                    f"the store runs with its S3 gateway on {bound or '127.0.0.1'}, not on "
                    f"{store.s3_bind or '127.0.0.1'}: make objectstore-down first (its data stays)")
            try:
                store.start()
            except ObjectStoreError:
                store.stop()  # nothing half-started left behind
                raise
            bucket = store.ensure_bucket(DEFAULT_BUCKET)
            how = "already running" if was_running else f"started in {store.last_start_seconds:.1f} s"
            also = f"; S3 also on {store.s3_bind}:{store.ports.s3}" if store.s3_bind else ""
            print(f"object store {how}: {store.endpoint}, bucket {bucket}{also} (pids {_pids(store)}, "
                  f"home {store.home}; credential in {store.credentials_file})")
        elif args.command == "down":
            print("object store stopped" if store.stop() else "object store was not running")
        else:
            if not store.is_running():
                part = f"; only in part: pids {_pids(store)} (make objectstore-down)" if store.pids() else ""
                print(f"object store not running (home {store.home}{part})")
                return 1
            rss = store.rss_bytes() or 0
            bound = store.running_s3_bind()
            also = f"; S3 also on {bound}:{store.ports.s3}" if bound else ""
            print(f"object store running: {store.endpoint}{also} (pids {_pids(store)}, RSS {rss / 2**20:.0f} MiB, "
                  f"home {store.home})")
    except KappaError as exc:
        print(f"objectstore: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("objectstore: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
