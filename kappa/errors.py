"""One-line error messages: what CLIs, DAG tasks, logs and status files show of a failure."""

from __future__ import annotations

__all__ = ["one_line"]


def one_line(failure: BaseException | str) -> str:
    """The first non-empty line of an exception's (or a failure text's) message; the exception's type name when
    it has no message."""
    text = str(failure).strip()
    if text:
        return text.splitlines()[0].strip()
    return type(failure).__name__ if isinstance(failure, BaseException) else ""
