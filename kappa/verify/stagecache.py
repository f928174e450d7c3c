"""Records a strict verification staged, kept for the next verification of the same version.

A verification re-runs a version over the records of every micro-batch its table holds
(:mod:`kappa.verify.recompute`); reading them from the log (or the archive) and staging them by recorded batch
is most of its cost. A version that follows a live stream is verified again later with the same batches plus
new ones: the staged records of the batches already seen are what they were (a committed batch's offsets never
change, and neither do a retained log's records), so only the new batches are read and staged.

.. code-block:: text

    $KAPPA_HOME/verify-cache/<view>_v<version>.lock   one verification of the version at a time uses its folder
                                                      (flock); another stages in a scratch folder of its own
    $KAPPA_HOME/verify-cache/<view>_v<version>/
      _manifest.json     what the folder holds: the key below, then its units - a folder each: the step of the
                         re-run it feeds (one recorded batch, or a coalesced run of them) and per recorded batch
                         its position, offsets per partition and the watermark its late rows were judged by -
                         written last, atomically
      _kappa_batch=<step>/_kappa_kind=<valid|late|invalid>/part-*.parquet   (kappa.runtime.rerun.stage_batches)

A unit is what one step of the re-run reads: a coalesced re-run's runs of recorded batches (a few big folders,
kappa.runtime.rerun.coalesce_steps) or, re-run one recorded batch at a time, each batch. The next check re-runs
the units it reuses as they were staged (coalesce_steps' ``fixed`` runs) and forms new ones from the batches
recorded since.

The key names everything the staged rows depend on besides the offsets: the run (the table's Delta id and the
run's application id), the topic, the run's start offsets, a bounded run's end timestamp, the record format
(its schema and the decoding code) and the view's late bound. Another key empties the folder. A unit is reused
only while every unit before it is too and its batches are recorded as they were; the first that differs and
every later one are staged again. Folders the manifest does not list (a check killed while staging) are
removed.

The cache holds at most ``KAPPA_VERIFY_CACHE_MB`` (the least recently verified versions' folders go first;
0: no cache, each verification stages into scratch and removes it). Deleting the folder is always safe: the
next verification reads the whole range again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.runtime.view import ViewDefinition

__all__ = ["LAYOUT", "Staging", "cache_root", "folder_bytes", "format_fingerprint", "prune", "staged_records", "staging"]

log = logging.getLogger("kappa.verify.stagecache")

#: Version of the folder layout and manifest; another one empties old folders.
LAYOUT = 2
MANIFEST = "_manifest.json"


def cache_root(settings: "Settings") -> Path:
    """Where verifications keep staged records: ``$KAPPA_HOME/verify-cache``."""
    return Path(settings.home) / "verify-cache"


def format_fingerprint(view: "ViewDefinition") -> str:
    """What decoding the view's stream depends on: its record format, the subject's JSON Schema and the
    decoding code."""
    from kappa.log.schemas import load
    from kappa.runtime import parsing

    digest = hashlib.sha256(repr(view.stream_format).encode())
    digest.update(json.dumps(load(view.stream_format.subject), sort_keys=True).encode())
    digest.update(Path(parsing.__file__).read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class Staging:
    """A folder of staged records by recorded batch (:func:`kappa.runtime.rerun.stage_batches` layout).

    Attributes:
        root: The folder.
        kept: True for a version's cache folder (kept after the verification), False for scratch.
        key: What the rows depend on besides the offsets (see the module docs).
        units: The units staged so far, in order: ``{"pos": the step's position, "batches": [per recorded batch
            {"pos", "read": {partition: [low, high]}, "late_after"}]}``.
    """

    root: Path
    kept: bool
    key: Mapping[str, Any]
    units: list[dict[str, Any]] = field(default_factory=list)

    def reuse(self, wanted: Sequence[dict[str, Any]], *, single: bool = False) -> list[list[int]]:
        """The leading units staged already for the recorded batches ``wanted`` (every batch of the run, as
        :meth:`entries` gives them), as the lists of batch positions each stands for; they stay, every other
        staged unit is removed. ``single``: only units of one recorded batch count (a re-run of one batch at a
        time). Units at the end whose batches read no record are left out (nothing staged to reuse: those batches
        start the next run)."""
        manifest = self._read_manifest()
        same_key = manifest is not None and manifest.get("key") == _plain(self.key)
        held = manifest["units"] if same_key else []
        units, done = [], 0
        for unit in held:
            n = len(unit["batches"])
            if unit["batches"] != list(wanted[done:done + n]) or single and n != 1:
                break
            units.append(unit)
            done += n
        while units and not any(b["read"] for b in units[-1]["batches"]):
            units.pop()
        changed = len(units) != len(held) or not same_key
        self.units = units
        keep = {f"_kappa_batch={u['pos']}" for u in units}
        for child in self.root.iterdir() if self.root.is_dir() else ():
            if child.name.startswith("_kappa_batch=") and child.name not in keep or child.name.startswith(".incoming"):
                shutil.rmtree(child, ignore_errors=True)
        if self.kept and changed:
            self._write_manifest()
        return [[b["pos"] for b in u["batches"]] for u in units]

    @staticmethod
    def entries(ranges: Sequence[tuple[int, Mapping[int, tuple[int, int]], int]]) -> list[dict[str, Any]]:
        """Manifest entries of :func:`kappa.runtime.rerun.batch_ranges` output."""
        return [{"pos": int(pos), "read": {str(p): [int(lo), int(hi)] for p, (lo, hi) in sorted(read.items())},
                 "late_after": int(late_after)} for pos, read, late_after in ranges]

    def incoming(self) -> Path:
        """An empty folder (inside the root, so moving out of it is a rename) to stage new batches into."""
        folder = self.root / ".incoming"
        shutil.rmtree(folder, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        return folder

    def adopt(self, incoming: Path | None, added: Sequence[dict[str, Any]]) -> None:
        """Move the units staged into ``incoming`` into the root and record them (``{"pos", "batches"}``; the
        manifest written last). ``incoming`` None: the units ``added`` read no record."""
        self.root.mkdir(parents=True, exist_ok=True)
        if incoming is not None and incoming.is_dir():
            for child in sorted(incoming.iterdir()):
                if child.name.startswith("_kappa_batch="):
                    shutil.rmtree(self.root / child.name, ignore_errors=True)
                    os.replace(child, self.root / child.name)
            shutil.rmtree(incoming, ignore_errors=True)
        self.units.extend(added)
        if self.kept:
            self._write_manifest()

    def records(self) -> int:
        """Records of the units staged (valid, late and invalid; by their offsets)."""
        return _records(self.units)

    # ------------------------------------------------------------------ manifest
    def _read_manifest(self) -> dict[str, Any] | None:
        try:
            manifest = json.loads((self.root / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) and isinstance(manifest.get("units"), list) else None

    def _write_manifest(self) -> None:
        tmp = self.root / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"key": _plain(self.key), "units": self.units}, separators=(",", ":")) + "\n")
        os.replace(tmp, self.root / MANIFEST)


def _records(units: Sequence[Mapping[str, Any]]) -> int:
    """Records the manifest units ``units`` stand for (by their batches' offsets)."""
    return sum(hi - lo for u in units for b in u["batches"] for lo, hi in b["read"].values())


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (string keys), so a key compares equal to the manifest's."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


@contextlib.contextmanager
def staging(settings: "Settings", view: "ViewDefinition", key: Mapping[str, Any] | None,
            scratch: str) -> Iterator[Staging]:
    """The version's cache folder, locked (``key`` given, the cache on, no other verification of the version
    using it), else a new folder under ``scratch`` removed afterwards. After a kept folder's use, the cache is
    pruned to its budget."""
    if key is None or settings.verify_cache_mb <= 0:
        yield from _scratch(scratch, view, key)
        return
    folder = cache_root(settings) / f"{view.name}_v{view.version}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder) as held:
        if not held:
            log.info("another verification of %s uses its staged records (%s); staging in scratch", view.ref, folder)
            yield from _scratch(scratch, view, key)
            return
        folder.mkdir(exist_ok=True)
        os.utime(folder)  # recently used: pruned last
        yield Staging(root=folder, kept=True, key={"layout": LAYOUT, **key})
    prune(settings, keep=folder)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[bool]:
    """Hold the lock of a version's folder (a file beside it, so removing the folder leaves the lock alone);
    yields False at once when another process holds it."""
    with open(folder.with_name(f"{folder.name}.lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _scratch(scratch: str, view: "ViewDefinition", key: Mapping[str, Any] | None) -> Iterator[Staging]:
    folder = Path(tempfile.mkdtemp(prefix=f"recompute-{view.name}-v{view.version}-", dir=scratch))
    try:
        yield Staging(root=folder / "staged", kept=False, key=dict(key or {}))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def staged_records(settings: "Settings", view: "ViewDefinition", run: str) -> int:
    """Records the version's cache folder holds staged for the run ``run`` (0: none, or another run's), read from
    its manifest without a lock - an estimate for what a verification about to start need not read again."""
    try:
        manifest = json.loads((cache_root(settings) / f"{view.name}_v{view.version}" / MANIFEST).read_text())
        return _records(manifest["units"]) if manifest["key"].get("run") == run else 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (0 when it is gone; a file removed meanwhile counts nothing)."""
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def prune(settings: "Settings", *, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used versions' folders until the cache holds at most ``KAPPA_VERIFY_CACHE_MB``
    (``keep`` last of all, and never while another verification holds its lock). Returns the folders removed."""
    root = cache_root(settings)
    if not root.is_dir():
        return []
    budget = settings.verify_cache_mb * 2**20
    folders = sorted((f for f in root.iterdir() if f.is_dir()),
                     key=lambda f: (f == keep, f.stat().st_mtime))
    sizes = {f: folder_bytes(f) for f in folders}
    total = sum(sizes.values())
    removed = []
    for folder in folders:
        if total <= budget:
            break
        with _locked(folder) as held:
            if not held:
                continue  # in use
            shutil.rmtree(folder, ignore_errors=True)
        total -= sizes[folder]
        removed.append(folder)
        log.info("verify cache: removed %s (%.0f MB; the cache keeps at most %d MB)", folder, sizes[folder] / 2**20,
                 settings.verify_cache_mb)
    return removed
