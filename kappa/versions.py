"""Pinned versions of the platform, read from ``infra/versions.env`` (the single source of truth).

The file is a plain ``KEY=VALUE`` list (comments with ``#``, optional quotes) that is also sourced by the
Makefile and ``infra/local/bootstrap.sh``; tests compare pins used elsewhere against it.

Example:
    >>> from kappa.versions import read_versions
    >>> read_versions()["SPARK_VERSION"]  # doctest: +SKIP
    '4.2.0'
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from kappa.errors import KappaError

__all__ = ["VERSIONS_FILE", "VersionsError", "parse_versions", "read_versions", "version"]

#: Default location: ``<repo>/infra/versions.env``.
VERSIONS_FILE: Path = Path(__file__).resolve().parents[1] / "infra" / "versions.env"

_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


class VersionsError(KappaError, ValueError):
    """``versions.env`` is malformed or lacks a key."""


def parse_versions(text: str, *, source: str = "versions.env") -> dict[str, str]:
    """Parse the text of a ``versions.env`` file.

    Args:
        text: File contents.
        source: Name used in error messages.

    Returns:
        Mapping of key to (unquoted) value, in file order.

    Raises:
        VersionsError: On a line that is neither blank, a comment nor ``KEY=VALUE``, or a duplicate key.
    """
    out: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise VersionsError(f"{source}:{lineno}: expected KEY=VALUE, got {raw!r}")
        key, value = m.group(1), m.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:  # trailing comment on an unquoted value
            value = value.split(" #", 1)[0].rstrip()
        if key in out:
            raise VersionsError(f"{source}:{lineno}: duplicate key {key}")
        out[key] = value
    return out


@cache
def _read(path: Path) -> dict[str, str]:
    return parse_versions(path.read_text(encoding="utf-8"), source=str(path))


def read_versions(path: Path | None = None) -> dict[str, str]:
    """Return all pins of ``infra/versions.env`` (or of ``path``) as a new dict.

    Args:
        path: Alternative file to read; defaults to :data:`VERSIONS_FILE`.
    """
    return dict(_read((path or VERSIONS_FILE).resolve()))


def version(key: str, *, path: Path | None = None) -> str:
    """Return one pin, e.g. ``version("KAFKA_VERSION")``.

    Raises:
        VersionsError: If the key is not defined.
    """
    pins = read_versions(path)
    try:
        return pins[key]
    except KeyError:
        raise VersionsError(f"{path or VERSIONS_FILE} does not define {key} (known: {', '.join(pins)})") from None
