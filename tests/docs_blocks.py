"""The shell blocks of the documentation, so a test can run them as a user would.

Every fenced ```bash block of README.md, docs/*.md and helm/kappa/README.md is a command the reader is told to
run. A block that cannot run on this machine carries a marker on the line right before its fence, with the
reason::

    <!-- docs-test: skip (needs a Kubernetes cluster) -->

``tests/test_first_hour.py`` runs every other block, verbatim, against a stack started by ``make run``. A block that
needs the real Kubernetes node instead carries::

    <!-- docs-test: cluster (what it does) -->

the first-hour walk skips it (its ``skip`` says so) and ``tests/cluster`` runs it, verbatim, on the node
(``make cluster-up``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Documentation read by users, in the order the walk runs its blocks: the README first, then the docs.
DOC_FILES = ("README.md", "docs/analysts.md", "docs/replay.md", "docs/deploy.md", "docs/performance.md", "helm/kappa/README.md")
SHELL = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<why>[^)]*)\)\s*-->")
_CLUSTER = re.compile(r"<!--\s*docs-test:\s*cluster\s*\((?P<why>[^)]*)\)\s*-->")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text (dedented) and why it is not run, if so."""

    path: str
    line: int
    lang: str
    text: str
    skip: str | None
    cluster: bool = False

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(root: Path = ROOT) -> list[Block]:
    """Every fenced block of :data:`DOC_FILES`, in order."""
    out: list[Block] = []
    for name in DOC_FILES:
        lines = (root / name).read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = _FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            indent, lang, start = m.group(1), m.group(2), i
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            before = lines[start - 1] if start > 0 else ""
            marker, cluster = _SKIP.search(before), _CLUSTER.search(before)
            skip = (marker.group("why").strip() if marker
                    else f"runs on the real node (tests/cluster): {cluster.group('why').strip()}" if cluster else None)
            out.append(Block(name, start + 1, lang, "\n".join(body) + "\n", skip, cluster is not None))
            i += 1
    return out


def shell_blocks(root: Path = ROOT) -> list[Block]:
    """The command blocks (:data:`SHELL` languages)."""
    return [b for b in blocks(root) if b.lang in SHELL]


def cluster_blocks(root: Path = ROOT) -> list[Block]:
    """The command blocks marked ``docs-test: cluster``, in order."""
    return [b for b in shell_blocks(root) if b.cluster]


def cluster_block(containing: str, root: Path = ROOT) -> Block:
    """The one ``docs-test: cluster`` block whose text contains ``containing`` (fails when none or several do)."""
    return _one(cluster_blocks(root), containing, "cluster blocks")


def shell_block(containing: str, root: Path = ROOT) -> Block:
    """The one command block whose text contains ``containing`` (fails when none or several do)."""
    return _one(shell_blocks(root), containing, "command blocks")


def python_block(containing: str, root: Path = ROOT) -> Block:
    """The one ```python block whose text contains ``containing`` (fails when none or several do)."""
    return _one([b for b in blocks(root) if b.lang == "python"], containing, "python blocks")


def _one(found: list[Block], containing: str, what: str) -> Block:
    found = [b for b in found if containing in b.text]
    if len(found) != 1:
        raise LookupError(f"{len(found)} {what} contain {containing!r}: {[b.where for b in found]}")
    return found[0]
