"""One driver per checkpoint: an exclusive, crash-safe lock next to the checkpoint, and on an object store a lease.

:class:`DriverLock`: ``fcntl.flock`` is released by the kernel when the holder dies (even by SIGKILL), so a crashed
driver never leaves a stale lock, while a second live driver is refused with who holds it. On a local lake it lies
beside the checkpoint; on an object store (no file locks there) it is local to the machine
(``kappa.runtime.job``), so it only excludes the drivers of one machine.

:class:`LakeLease`: across machines, on an object-store lake, one object beside the checkpoint
(``<checkpoint>/driver.lease``) says which driver holds the version. It is taken with a conditional create
(``If-None-Match: *``: of two drivers starting at once exactly one gets it) and kept by renewals every quarter of
its time-to-live (every 2 s while the store does not answer), each conditional on the ETag of the driver's own last
write (``If-Match``), so a driver notices at once when another took it over. A starting driver finding the lease held

- by a stopped driver (its release left a ``released`` marker) takes it at once;
- by a driver of this machine whose process is gone (a crash, a container restarted in its pod) takes it at once;
- otherwise watches it: a live holder renews it within a quarter of its time-to-live, and the newcomer is refused
  (:class:`DriverAlreadyRunning`, naming the holder); a lease unchanged for a whole time-to-live belonged to a
  driver that died (a lost node) and is taken over, conditional on the ETag watched.

Time is only ever measured on the watcher's own monotonic clock, never compared across machines. Before every
micro-batch commit the holder calls :meth:`LakeLease.check`: a lease it renewed within five sixths of the
time-to-live is still its own (no one takes over before a whole one); an older one is renewed there and then, and
when that fails - the lease was taken, or the store does not answer - :class:`DriverLeaseLost` fails the
micro-batch and the query. A store outage is waited out as long as no commit comes due more than five sixths of the
time-to-live after the last renewal (at least 70 s at the default 120 s). What a lease cannot fence is a driver
paused for longer than the time-to-live *between* that check and its commit: its table stays exactly-once all the
same (Delta's transaction ids make a micro-batch committed twice a no-op).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kappa.errors import KappaError, one_line

__all__ = ["DriverAlreadyRunning", "DriverLeaseLost", "DriverLock", "LakeLease"]

log = logging.getLogger("kappa.runtime.lock")

#: The lease objects this process holds (a second driver of one version in this process is refused, not taken over).
_HELD: set[str] = set()


class DriverAlreadyRunning(KappaError, RuntimeError):
    """Another driver already runs this view version."""


class DriverLeaseLost(KappaError, RuntimeError):
    """This driver no longer holds its lease on the lake: another took it over, or it could not renew it in time."""


class DriverLock:
    def __init__(self, path: Path, *, owner: str) -> None:
        self.path = Path(path)
        self.owner = owner
        self._fd: int | None = None

    def holder(self) -> dict | None:
        """Who holds the lock (pid, host, owner, since), or None when it is free."""
        if not self.path.exists():
            return None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(self.path.read_text() or "{}")
            except (OSError, ValueError):
                return {}
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = self.holder() or {}
            raise DriverAlreadyRunning(
                f"{self.owner} is already running (pid {info.get('pid', '?')} on {info.get('host', '?')} "
                f"since {info.get('since', '?')}); stop it first - two drivers on one checkpoint corrupt it"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "owner": self.owner,
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DriverLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class LakeLease:
    """The lease of one view version's driver on an object-store lake (see the module's docs).

    Args:
        uri: The lease object (``<checkpoint>/driver.lease``, an ``s3a://``/``s3://`` URL).
        owner: What holds it (``view@vN``), for messages.
        ttl_seconds: How long the lease outlives its holder's last renewal (``KAPPA_DRIVER_LEASE_SECONDS``).
    """

    def __init__(self, uri: str, *, owner: str, ttl_seconds: float = 120.0) -> None:
        self.uri = uri
        self.owner = owner
        self.ttl = float(ttl_seconds)
        self.me = {"holder": uuid.uuid4().hex, "pid": os.getpid(), "host": socket.gethostname(), "owner": owner,
                   "ttl_seconds": self.ttl}
        self._etag: str | None = None
        self._renewed = 0.0  # monotonic time of the last successful write
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io = threading.Lock()  # one conditional write at a time (two with one ETag: the second would fail)
        self._since = ""
        self.took_over: str | None = None  # whose lease it took at its start, for the log

    # ------------------------------------------------------------------ the object
    def _object(self) -> tuple[Any, str]:
        from kappa.runtime.checkpoint import _object

        return _object(self.uri)

    def _read(self) -> tuple[dict | None, str | None]:
        import obstore

        store, key = self._object()
        try:
            got = obstore.get(store, key)
        except FileNotFoundError:
            return None, None
        etag = got.meta.get("e_tag")
        try:
            return json.loads(bytes(got.bytes()).decode() or "{}"), etag
        except ValueError:
            return {}, etag

    def _put(self, body: dict, mode: Any) -> str:
        import obstore

        store, key = self._object()
        return obstore.put(store, key, json.dumps(body).encode(), mode=mode)["e_tag"]

    def holder(self) -> dict | None:
        """Who holds the lease as its object says (None when free or released)."""
        body, _ = self._read()
        return None if not body or body.get("released") else body

    # ------------------------------------------------------------------ taking it
    def acquire(self) -> None:
        """Take the lease (see the module's docs); :class:`DriverAlreadyRunning` when a live driver holds it."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        self._since = _now()
        body = {**self.me, "since": self._since}
        while True:
            try:
                self._held(self._put(body, "create"))
                return
            except AlreadyExistsError:
                pass
            current, etag = self._read()
            if current is None:
                continue  # released and deleted meanwhile: create again
            stale = self._stale(current, etag)
            try:
                self._held(self._put(body, {"e_tag": stale}))
            except PreconditionError:
                continue  # another driver changed it first: look again
            if current and not current.get("released"):
                self.took_over = f"pid {current.get('pid', '?')} on {current.get('host', '?')}"
                log.warning("%s: took over the driver lease of %s (%s)", self.owner, self.took_over,
                            "its process is gone" if current.get("host") == self.me["host"]
                            else f"unchanged for {self.ttl:.0f} s")
            return

    def _stale(self, current: dict, etag: str | None) -> str | None:
        """The ETag of a lease no live driver holds (to take it over conditionally); raises DriverAlreadyRunning."""
        if not current or current.get("released"):
            return etag
        mine = current.get("pid") == os.getpid() and self.uri not in _HELD  # an earlier process with this pid
        if current.get("host") == self.me["host"] and (mine or not _pid_alive(current.get("pid"))):
            return etag
        deadline = time.monotonic() + float(current.get("ttl_seconds") or self.ttl)
        log.info("%s: the driver lease is held by pid %s on %s; waiting up to %.0f s to see whether it is renewed",
                 self.owner, current.get("pid", "?"), current.get("host", "?"), deadline - time.monotonic())
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
            now, now_etag = self._read()
            if now_etag != etag:
                if now is None or (now and now.get("released")):
                    return now_etag
                raise DriverAlreadyRunning(
                    f"{self.owner} is already running (pid {now.get('pid', '?')} on {now.get('host', '?')} since "
                    f"{now.get('since', '?')}: it renews its lease on the lake); stop it first - two drivers on one "
                    "checkpoint corrupt it")
        return etag

    def _held(self, etag: str) -> None:
        self._etag, self._renewed, self._lost = etag, time.monotonic(), None
        _HELD.add(self.uri)
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.owner}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ keeping it
    def _renew(self) -> None:
        """One renewal, conditional on this driver's last write (``PreconditionError`` when another took it)."""
        with self._io:
            self._etag = self._put({**self.me, "since": self._since, "renewed": _now()}, {"e_tag": self._etag})
            self._renewed = time.monotonic()

    def _renew_loop(self) -> None:
        from obstore.exceptions import PreconditionError

        interval = self.ttl / 4
        while not self._stop.wait(interval):
            try:
                self._renew()
                interval = self.ttl / 4
            except PreconditionError:
                self._lose("another driver took over its lease on the lake")
                return
            except Exception as exc:  # noqa: BLE001 - the store unreachable: tried again every 2 s until it answers
                log.warning("%s: cannot renew the driver lease: %s", self.owner, one_line(exc))
                interval = min(2.0, self.ttl / 4)

    def _lose(self, why: str) -> None:
        self._lost = why
        log.error("%s: %s; this driver stops committing", self.owner, why)

    def check(self) -> None:
        """Before a commit: raise :class:`DriverLeaseLost` unless the lease is this driver's. A lease not renewed for
        five sixths of its TTL (others may take it over after a whole TTL) is renewed here first: a conditional
        write that succeeds proves no other driver wrote it since."""
        from obstore.exceptions import PreconditionError

        if self._etag is None:
            return
        stale = time.monotonic() - self._renewed
        if self._lost is None and stale > self.ttl * 5 / 6:
            try:
                self._renew()
            except PreconditionError:
                self._lose("another driver took over its lease on the lake")
            except Exception as exc:  # noqa: BLE001 - cannot tell: do not commit
                raise DriverLeaseLost(f"{self.owner}: its lease on the lake was last renewed {stale:.0f} s ago and "
                                      f"cannot be renewed now ({one_line(exc)}); another driver may hold it") from None
        if self._lost is not None:
            raise DriverLeaseLost(f"{self.owner}: {self._lost}; another driver holds it now")

    def release(self) -> None:
        """Stop renewing and mark the lease released (conditional on it still being this driver's)."""
        from obstore.exceptions import PreconditionError

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._etag is not None and self._lost is None:
            try:
                with self._io:
                    self._put({**self.me, "released": _now()}, {"e_tag": self._etag})
            except PreconditionError:
                pass  # taken over meanwhile: it is not this driver's to release
            except Exception as exc:  # noqa: BLE001 - the store unreachable: the lease expires by itself
                log.warning("%s: cannot release the driver lease (it expires in %.0f s): %s", self.owner, self.ttl,
                            one_line(exc))
        self._etag = None
        _HELD.discard(self.uri)
