"""Versioned JSON Schemas of the platform's events, validation, and a backward-compatibility checker.

Layout: ``schemas/<subject>/v<N>.json`` (N = 1, 2, ... without gaps). The *subject* names the kind of
record (``ad_event``, ``campaign``); see ``schemas/README.md`` for the rules.

Compatibility rule (BACKWARD, checked between every pair of consecutive versions): a reader using
version N must accept every record that was valid under version N-1, because a replay re-reads the
whole retained log, old records included. :func:`check_compatible` implements this for the JSON Schema
subset the platform uses (``type``, ``properties``, ``required``, ``additionalProperties``, ``enum``,
``const``, ``format``, ``pattern``, numeric and length bounds, ``items``) and fails closed on anything else.

Example:
    >>> from kappa.log import schemas
    >>> schemas.validate("campaign", {"campaign_id": "7d3c2f0e-8c2b-4a43-9a4e-3f0b7c0c1a11"})
    >>> schemas.spark_schema("campaign")
    '`campaign_id` STRING'
    >>> schemas.check_all()
    []
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

from kappa.errors import KappaError

__all__ = [
    "SCHEMAS_DIR",
    "CompatibilityIssue",
    "SchemaError",
    "SchemaValidationError",
    "check_all",
    "check_compatible",
    "errors",
    "is_valid",
    "latest_version",
    "load",
    "spark_schema",
    "subjects",
    "validate",
    "versions",
]

#: Default schema root, ``<repo>/schemas``.
SCHEMAS_DIR: Path = Path(__file__).resolve().parents[2] / "schemas"

_VERSION_FILE = re.compile(r"^v([1-9][0-9]*)\.json$")

#: Keywords that only annotate and never change which instances are valid.
_ANNOTATIONS = frozenset(
    {"$schema", "$id", "$comment", "title", "description", "examples", "default", "deprecated",
     "readOnly", "writeOnly"}
)
#: Keywords the compatibility checker understands.
_SUPPORTED = _ANNOTATIONS | {
    "type", "properties", "required", "additionalProperties", "enum", "const", "format", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
    "items", "minItems", "maxItems",
}
_SPARK_TYPES = {"string": "STRING", "integer": "BIGINT", "number": "DOUBLE", "boolean": "BOOLEAN"}


class SchemaError(KappaError, ValueError):
    """A subject/version does not exist or a schema file is not a valid JSON Schema."""


class SchemaValidationError(KappaError, ValueError):
    """A record does not match its schema; :attr:`errors` lists every violation."""

    def __init__(self, subject: str, version: int, errors: list[str]) -> None:
        self.subject, self.version, self.errors = subject, version, errors
        super().__init__(f"{subject} v{version}: " + "; ".join(errors))


@dataclass(frozen=True, slots=True)
class CompatibilityIssue:
    """One reason why ``new_version`` cannot read data written with ``old_version``.

    Attributes:
        subject: Schema subject.
        old_version: Writer version.
        new_version: Reader version.
        path: JSON pointer-like location in the schema (``/properties/ad_type``).
        message: What is incompatible.
    """

    subject: str
    old_version: int
    new_version: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.subject} v{self.old_version}->v{self.new_version} {self.path or '/'}: {self.message}"


# --------------------------------------------------------------------------------------- loading
def _root(root: Path | None) -> Path:
    return Path(root) if root is not None else SCHEMAS_DIR


def subjects(*, root: Path | None = None) -> list[str]:
    """Subjects (folders holding at least one ``v<N>.json``), sorted."""
    base = _root(root)
    if not base.is_dir():
        return []
    return sorted(d.name for d in base.iterdir() if d.is_dir() and any(_versions_in(d)))


def _versions_in(folder: Path) -> Iterator[int]:
    for f in folder.iterdir():
        m = _VERSION_FILE.match(f.name)
        if m and f.is_file():
            yield int(m.group(1))


def versions(subject: str, *, root: Path | None = None) -> list[int]:
    """Versions of a subject, ascending.

    Raises:
        SchemaError: If the subject has no schema files.
    """
    folder = _root(root) / subject
    found = sorted(_versions_in(folder)) if folder.is_dir() else []
    if not found:
        raise SchemaError(f"unknown schema subject {subject!r} (known: {', '.join(subjects(root=root)) or 'none'})")
    return found


def latest_version(subject: str, *, root: Path | None = None) -> int:
    """Highest version of a subject."""
    return versions(subject, root=root)[-1]


@cache
def _load_file(path: Path) -> dict[str, Any]:
    from jsonschema.exceptions import SchemaError as JSchemaError
    from jsonschema.validators import Draft202012Validator

    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path}: not valid JSON: {exc}") from exc
    try:
        Draft202012Validator.check_schema(schema)
    except JSchemaError as exc:
        raise SchemaError(f"{path}: not a valid JSON Schema (2020-12): {exc.message}") from exc
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise SchemaError(f"{path}: top-level schema must have type 'object'")
    return schema


def load(subject: str, version: int | None = None, *, root: Path | None = None) -> dict[str, Any]:
    """Load a schema (latest version if ``version`` is None). Returns a fresh copy.

    Raises:
        SchemaError: Unknown subject/version or invalid schema file.
    """
    available = versions(subject, root=root)
    v = available[-1] if version is None else version
    if v not in available:
        raise SchemaError(f"{subject} has no version {v} (available: {available})")
    path = (_root(root) / subject / f"v{v}.json").resolve()
    copy: dict[str, Any] = json.loads(json.dumps(_load_file(path)))
    return copy


@cache
def _validator(path: Path) -> Any:
    from jsonschema.validators import Draft202012Validator

    return Draft202012Validator(_load_file(path), format_checker=Draft202012Validator.FORMAT_CHECKER)


# ------------------------------------------------------------------------------------ validation
def errors(subject: str, obj: Any, *, version: int | None = None, root: Path | None = None) -> list[str]:
    """All violations of ``obj`` against the schema (empty list = valid), as ``"<path>: <message>"``."""
    v = latest_version(subject, root=root) if version is None else version
    load(subject, v, root=root)  # raises SchemaError for unknown versions
    validator = _validator((_root(root) / subject / f"v{v}.json").resolve())
    out = []
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = "/" + "/".join(map(str, err.absolute_path))
        msg = err.message if len(err.message) <= 200 else err.message[:200] + "..."
        out.append(f"{where}: {msg}")
    return out


def is_valid(subject: str, obj: Any, *, version: int | None = None, root: Path | None = None) -> bool:
    """True if ``obj`` is valid for the subject (latest version by default)."""
    return not errors(subject, obj, version=version, root=root)


def validate(subject: str, obj: Any, *, version: int | None = None, root: Path | None = None) -> None:
    """Validate a decoded record (formats ``uuid``/``ipv4`` included).

    Raises:
        SchemaValidationError: With every violation.
    """
    found = errors(subject, obj, version=version, root=root)
    if found:
        v = latest_version(subject, root=root) if version is None else version
        raise SchemaValidationError(subject, v, found)


# ------------------------------------------------------------------------------- compatibility
def _types(schema: Mapping[str, Any]) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None  # any type
    return {t} if isinstance(t, str) else set(t)


def _type_covered(old: str, new: set[str]) -> bool:
    return old in new or (old == "integer" and "number" in new)


def check_compatible(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    subject: str = "",
    old_version: int = 0,
    new_version: int = 0,
) -> list[CompatibilityIssue]:
    """Check that ``new`` (reader) accepts every instance valid under ``old`` (writer): BACKWARD.

    Rules (for the supported keyword subset; anything else is reported as unsupported):

    * ``type``: the new type set must cover the old one (``integer`` -> ``number`` widens; the reverse
      narrows).
    * ``required``: a field required in ``new`` must be required in ``old`` too, unless ``new`` gives
      it a ``default`` the reader fills in.
    * ``enum`` / ``const``: no old value may disappear; adding an enum/const where there was none narrows.
    * ``properties``: shared properties are checked recursively; a property removed from ``new`` is
      fine unless ``new`` sets ``additionalProperties: false``; a property *added* to ``new`` is
      accepted (policy: old records never used that name for something else).
    * ``additionalProperties``: may not become ``false`` (or stricter) when it was open.
    * ``format`` / ``pattern``: may be removed, not added or changed.
    * bounds (``minimum``, ``maxLength``, ``minItems``, ...): may only widen.
    * ``items``: checked recursively.

    Returns:
        The incompatibilities found (empty list = compatible).
    """
    issues: list[CompatibilityIssue] = []

    def report(path: str, message: str) -> None:
        issues.append(CompatibilityIssue(subject, old_version, new_version, path, message))

    for side, schema in (("old", old), ("new", new)):
        for where, keywords in _unsupported(schema, ""):
            report(where, f"unsupported keyword(s) in {side} schema: {', '.join(keywords)} "
                          "(the checker cannot prove compatibility)")
    _compare(old, new, "", report)
    return issues


def _unsupported(schema: Any, path: str) -> Iterator[tuple[str, list[str]]]:
    """Every location (in the whole tree) using keywords outside the supported subset."""
    if not isinstance(schema, Mapping):
        return
    extra = sorted(set(schema) - _SUPPORTED)
    if extra:
        yield path, extra
    for name, sub in (schema.get("properties") or {}).items():
        yield from _unsupported(sub, f"{path}/properties/{name}")
    for kw in ("items", "additionalProperties"):
        if isinstance(schema.get(kw), Mapping):
            yield from _unsupported(schema[kw], f"{path}/{kw}")


def _compare(old: Any, new: Any, path: str, report: Any) -> None:
    if isinstance(old, bool) or isinstance(new, bool):
        if new is False and old is not False:
            report(path, "schema became 'false' (rejects everything)")
        return
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        report(path, "schema must be an object")
        return
    # type
    old_t, new_t = _types(old), _types(new)
    if new_t is not None:
        if old_t is None:
            report(path, f"type narrowed from any to {sorted(new_t)}")
        else:
            lost = sorted(t for t in old_t if not _type_covered(t, new_t))
            if lost:
                report(path, f"type narrowed: {sorted(old_t)} -> {sorted(new_t)} (old data of type {lost} rejected)")

    # enum / const
    if "enum" in new:
        if "enum" in old:
            removed = [v for v in old["enum"] if v not in new["enum"]]
            if removed:
                report(path, f"enum value(s) removed: {removed}")
        elif "const" in old:
            if old["const"] not in new["enum"]:
                report(path, f"const {old['const']!r} is not in the new enum")
        else:
            report(path, f"enum added where any value was allowed: {new['enum']}")
    if "const" in new:
        old_values = old.get("enum", [old["const"]] if "const" in old else None)
        if old_values is None or any(v != new["const"] for v in old_values):
            report(path, f"const {new['const']!r} added/changed")

    # format / pattern
    for kw in ("format", "pattern"):
        if kw in new and new[kw] != old.get(kw):
            change = "added" if kw not in old else f"changed from {old[kw]!r}"
            report(path, f"{kw} {new[kw]!r} {change} (old data may not match)")

    # bounds: (keyword, True if a larger value is narrower)
    for kw, larger_is_narrower in (
        ("minimum", True), ("exclusiveMinimum", True), ("minLength", True), ("minItems", True),
        ("maximum", False), ("exclusiveMaximum", False), ("maxLength", False), ("maxItems", False),
    ):
        if kw not in new:
            continue
        if kw not in old:
            report(path, f"{kw}={new[kw]} added (old data may violate it)")
        elif (new[kw] > old[kw]) if larger_is_narrower else (new[kw] < old[kw]):
            report(path, f"{kw} narrowed: {old[kw]} -> {new[kw]}")

    # objects
    old_props: Mapping[str, Any] = old.get("properties", {})
    new_props: Mapping[str, Any] = new.get("properties", {})
    old_req, new_req = set(old.get("required", [])), set(new.get("required", []))
    for name in sorted(new_req - old_req):
        prop = new_props.get(name, {})
        if not (isinstance(prop, Mapping) and "default" in prop):
            report(f"{path}/required", f"new required field {name!r} without a default (old records lack it)")
    old_add = old.get("additionalProperties", True)
    new_add = new.get("additionalProperties", True)
    if new_add is False and old_add is not False:
        report(path, "additionalProperties became false (old records with extra fields rejected)")
    elif isinstance(new_add, Mapping) and old_add is not False:
        _compare(old_add if isinstance(old_add, Mapping) else {}, new_add, f"{path}/additionalProperties", report)
    for name in old_props:
        sub = f"{path}/properties/{name}"
        if name in new_props:
            _compare(old_props[name], new_props[name], sub, report)
        elif new_add is False:
            report(sub, "property removed while additionalProperties is false (old records rejected)")
        elif isinstance(new_add, Mapping):
            _compare(old_props[name], new_add, sub, report)

    # arrays
    if "items" in new:
        _compare(old.get("items", {}), new["items"], f"{path}/items", report)


def check_all(*, root: Path | None = None) -> list[CompatibilityIssue]:
    """Check every subject: schema files valid, versions without gaps, each version backward
    compatible with the previous one.

    Returns:
        Every issue found (empty list = all good). Structural problems (gaps, invalid files) are
        reported as issues with ``path`` ``"(file)"``.
    """
    issues: list[CompatibilityIssue] = []
    for subject in subjects(root=root):
        vs = versions(subject, root=root)
        if vs != list(range(1, len(vs) + 1)):
            issues.append(
                CompatibilityIssue(subject, 0, vs[-1], "(file)", f"versions must be v1..vN without gaps, found {vs}")
            )
        loaded: dict[int, dict[str, Any]] = {}
        for v in vs:
            try:
                loaded[v] = load(subject, v, root=root)
            except SchemaError as exc:
                issues.append(CompatibilityIssue(subject, v, v, "(file)", str(exc)))
        for old_v, new_v in pairwise(vs):
            if old_v in loaded and new_v in loaded:
                issues.extend(
                    check_compatible(
                        loaded[old_v], loaded[new_v], subject=subject, old_version=old_v, new_version=new_v
                    )
                )
    return issues


# ----------------------------------------------------------------------------------------- spark
def _spark_type(schema: Mapping[str, Any], path: str) -> str:
    types = _types(schema) or set()
    types.discard("null")
    if len(types) != 1:
        raise SchemaError(f"{path}: cannot map type {sorted(types) or 'any'} to a Spark type (need exactly one)")
    (t,) = types
    if t in _SPARK_TYPES:
        return _SPARK_TYPES[t]
    if t == "object":
        props = schema.get("properties", {})
        if not props:
            return "MAP<STRING, STRING>"
        fields = ", ".join(f"`{n}`: {_spark_type(p, f'{path}/{n}')}" for n, p in props.items())
        return f"STRUCT<{fields}>"
    if t == "array":
        return f"ARRAY<{_spark_type(schema.get('items', {'type': 'string'}), path + '/items')}>"
    raise SchemaError(f"{path}: unsupported JSON type {t!r}")


def spark_schema(subject: str, version: int | None = None, *, root: Path | None = None) -> str:
    """Spark DDL for a subject's records, for ``from_json(col, ddl)`` -- no pyspark import here.

    Properties keep the schema's order; ``integer`` maps to ``BIGINT`` (epoch millis fit), ``number``
    to ``DOUBLE``. Columns are nullable: ``from_json`` yields NULL for a missing/mistyped field, and the
    job decides what is malformed (e.g. with :func:`validate` semantics: required fields non-null).

    Example:
        >>> spark_schema("ad_event")  # doctest: +ELLIPSIS
        '`user_id` STRING, `page_id` STRING, `ad_id` STRING, ..., `event_time` BIGINT, ...'
    """
    schema = load(subject, version, root=root)
    return ", ".join(f"`{n}` {_spark_type(p, '/' + n)}" for n, p in schema.get("properties", {}).items())
