"""The platform's errors: one base class, and the one line every front end shows of a failure.

Every refusal or failure the platform explains to its user (a bad request, a view version that cannot be verified,
a registry conflict, a broker that will not start...) is a :class:`KappaError`; the CLI prints it as one line
(exit 2), a DAG task fails with that line and no retries, and logs and status files carry :func:`one_line` of it.
The concrete classes keep a builtin base too (``ValueError`` for a request that cannot be served as asked,
``RuntimeError`` for a part that failed) so callers may catch either.
"""

from __future__ import annotations

__all__ = ["KappaError", "one_line"]


class KappaError(Exception):
    """A failure the platform explains in its message (:func:`one_line` of it is what users see)."""


def one_line(failure: BaseException | str) -> str:
    """The first non-empty line of an exception's (or a failure text's) message; the exception's type name when
    it has no message."""
    text = str(failure).strip()
    if text:
        return text.splitlines()[0].strip()
    return type(failure).__name__ if isinstance(failure, BaseException) else ""
