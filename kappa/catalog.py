"""The platform's declarations: topics of the retained log and the views maintained from them.

``kappa/platform.yaml`` is the only list of topics and views (the Helm chart reads the same file). This
module parses it into frozen dataclasses and validates it, reporting *every* problem at once with its
location in the file.

Example:
    >>> from kappa.catalog import load_catalog
    >>> cat = load_catalog()
    >>> cat.topic("ad-events").partitions  # doctest: +SKIP
    4
    >>> cat.view("user_sessions").module()  # doctest: +SKIP
    'jobs.user_sessions.v1'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kappa.config import PLATFORM_FILE
from kappa.errors import KappaError
from kappa.identity import VIEW_NAME

__all__ = [
    "platform_file",
    "Catalog",
    "CatalogError",
    "TopicSpec",
    "UnknownView",
    "ViewSpec",
    "load_catalog",
    "parse_catalog",
]

def platform_file() -> Path:
    """The declaration file in use: ``$KAPPA_PLATFORM`` when set (a team's own views: a copy of ``platform.yaml``
    with its views added, their modules on ``PYTHONPATH``), else :data:`kappa.config.PLATFORM_FILE`."""
    from kappa.config import Settings

    return Settings.from_env().platform

_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class UnknownView(KappaError, ValueError):
    """A view or view version that ``platform.yaml`` does not declare (one line naming what it declares)."""


class CatalogError(KappaError, ValueError):
    """``platform.yaml`` is invalid; ``errors`` lists every problem as ``"<path>: <message>"``."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in errors)
        super().__init__(f"{source}: {len(errors)} problem(s):\n{lines}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicSpec:
    """A declared Kafka topic.

    Attributes:
        name: Topic name.
        partitions: Declared partition count (the platform only ever *adds* partitions).
        replication_factor: Replication factor used at creation (cannot be changed afterwards).
        config: Topic-level configs (string values, as Kafka reports them).
        description: Human description.
    """

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str] = field(default_factory=dict)
    description: str = ""


_DURATION = re.compile(r"^([1-9][0-9]*)([dhms])$")
_UNIT_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000}


def parse_duration_ms(value: object) -> int:
    """``<n>d|h|m|s`` in milliseconds, 0 when it is not one (an error)."""
    match = _DURATION.match(str(value).strip().lower())
    return int(match.group(1)) * _UNIT_MS[match.group(2)] if match else 0


def parse_retention(value: object) -> int | None:
    """An archive's ``retention``: milliseconds, None for ``forever``, 0 when it is neither (an error)."""
    return None if str(value).strip().lower() == "forever" else parse_duration_ms(value)


#: Longest ``trigger`` a view may declare: a live view further behind than this is not a view one serves.
MAX_TRIGGER_SECONDS = 3600


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewSpec:
    """A declared view: a Delta table maintained from topics, in one or more versions.

    Attributes:
        name: View name (also the serving alias).
        description: Human description.
        topics: Topics the view reads.
        default_version: Version served by default (must be a key of ``versions``).
        versions: Version number -> importable module implementing that version (``jobs.<view>.vN``).
        archives: The stream topic this view archives (every record, valid or not: the replay source for history
            the log no longer holds, :mod:`kappa.runtime.archive`), else None.
        retention_ms: How long an archive keeps a record (``retention: <n>d|h|m|s`` or ``forever``, with
            ``archives`` only): older whole prefixes of a partition leave it (:func:`kappa.runtime.archive.keep`);
            None keeps every record.
        trigger_seconds: How often the view's live micro-batches run (``trigger: <n>s|m``), whatever its versions'
            modules declare - an operational setting beside the declaration, not part of a version's code: a view
            nobody reads for second-fresh rows (the archive) spares the driver most of a micro-batch's fixed cost.
            None: each version's own (``ViewDefinition.trigger_seconds``), else 2 s.
    """

    name: str
    description: str
    topics: tuple[str, ...]
    default_version: int
    versions: dict[int, str]
    archives: str | None = None
    retention_ms: int | None = None
    trigger_seconds: float | None = None

    def module(self, version: int | None = None) -> str:
        """Module implementing ``version`` (default: :attr:`default_version`).

        Raises:
            KeyError: If the version is not declared.
        """
        v = self.default_version if version is None else version
        try:
            return self.versions[v]
        except KeyError:
            raise KeyError(
                f"view {self.name!r} has no version {v} (declared: {sorted(self.versions)})"
            ) from None


@dataclass(frozen=True, slots=True)
class Catalog:
    """All declarations of one ``platform.yaml``.

    Attributes:
        topics: Topic name -> spec, in file order.
        views: View name -> spec, in file order.
        source: Path of the file it was loaded from.
    """

    topics: dict[str, TopicSpec]
    views: dict[str, ViewSpec]
    source: Path | None = None

    def topic(self, name: str) -> TopicSpec:
        """Return a topic spec; ``KeyError`` naming the known topics if absent."""
        try:
            return self.topics[name]
        except KeyError:
            raise KeyError(f"unknown topic {name!r} (declared: {', '.join(self.topics)})") from None

    def view(self, name: str) -> ViewSpec:
        """Return a view spec.

        Raises:
            UnknownView: The view is not declared (the message names the declared ones).
        """
        try:
            return self.views[name]
        except KeyError:
            raise UnknownView(f"unknown view {name!r}; declared views: {', '.join(sorted(self.views))}") from None

    def module_of(self, view: str, version: int | None = None) -> str:
        """The module implementing a declared view version (the view's default version when None).

        Raises:
            UnknownView: The view, or that version of it, is not declared (one line naming what is).
        """
        spec = self.view(view)
        v = spec.default_version if version is None else version
        if v not in spec.versions:
            where = "kappa/platform.yaml" if self.source is None or Path(self.source) == PLATFORM_FILE else self.source
            raise UnknownView(f"{view} has no version {v} in {where} "
                              f"(declared: {', '.join(map(str, sorted(spec.versions)))})")
        return spec.versions[v]


def load_catalog(path: Path | str | None = None) -> Catalog:
    """Load and validate ``platform.yaml``.

    Args:
        path: File to read; defaults to :func:`platform_file` (``$KAPPA_PLATFORM``, else ``kappa/platform.yaml``).

    Raises:
        CatalogError: With every validation problem found.
        FileNotFoundError: If the file does not exist.
    """
    p = Path(path) if path is not None else platform_file()
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise CatalogError(str(p), [f"not valid YAML: {exc}"]) from exc
    return parse_catalog(data, source=p)


def parse_catalog(data: Any, *, source: Path | str | None = None) -> Catalog:
    """Validate an already-parsed YAML document and build the :class:`Catalog`.

    Args:
        data: The document (a mapping with ``topics`` and ``views``).
        source: File name used in messages and stored in :attr:`Catalog.source`.

    Raises:
        CatalogError: With every validation problem found.
    """
    src = str(source) if source is not None else "<platform>"
    errors: list[str] = []
    if not isinstance(data, Mapping):
        raise CatalogError(src, ["top level must be a mapping with 'topics' and 'views'"])
    unknown = set(data) - {"topics", "views"}
    if unknown:
        errors.append(f"unknown top-level key(s): {', '.join(sorted(map(str, unknown)))}")

    topics = _parse_topics(data.get("topics"), errors)
    views = _parse_views(data.get("views"), set(topics), errors)
    if errors:
        raise CatalogError(src, errors)
    return Catalog(topics=topics, views=views, source=Path(source) if source is not None else None)


# ---------------------------------------------------------------------------------------- helpers
def _config_value(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return str(value)
    return None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _parse_topics(raw: Any, errors: list[str]) -> dict[str, TopicSpec]:
    if not isinstance(raw, Mapping) or not raw:
        errors.append("topics: must be a non-empty mapping of topic name -> spec")
        return {}
    out: dict[str, TopicSpec] = {}
    for name, spec in raw.items():
        where = f"topics.{name}"
        if not isinstance(name, str) or not _TOPIC_NAME.match(name) or name in {".", ".."}:
            errors.append(f"{where}: invalid Kafka topic name (letters, digits, '.', '_', '-'; max 249)")
            continue
        if not isinstance(spec, Mapping):
            errors.append(f"{where}: must be a mapping")
            continue
        unknown = set(spec) - {"description", "partitions", "replication_factor", "config"}
        if unknown:
            errors.append(f"{where}: unknown key(s): {', '.join(sorted(map(str, unknown)))}")
        partitions = _positive_int(spec.get("partitions"))
        if partitions is None:
            errors.append(f"{where}.partitions: must be an integer >= 1, got {spec.get('partitions')!r}")
        rf = _positive_int(spec.get("replication_factor", 1))
        if rf is None:
            errors.append(
                f"{where}.replication_factor: must be an integer >= 1, got {spec.get('replication_factor')!r}"
            )
        config: dict[str, str] = {}
        raw_config = spec.get("config") or {}
        if not isinstance(raw_config, Mapping):
            errors.append(f"{where}.config: must be a mapping of Kafka topic config -> value")
        else:
            for key, value in raw_config.items():
                text = _config_value(value)
                if not isinstance(key, str) or text is None:
                    errors.append(f"{where}.config.{key}: value must be a string or integer, got {value!r}")
                else:
                    config[key] = text
        description = spec.get("description", "")
        if not isinstance(description, str):
            errors.append(f"{where}.description: must be a string")
            description = str(description)
        if partitions is not None and rf is not None:
            out[name] = TopicSpec(
                name=name, partitions=partitions, replication_factor=rf, config=config,
                description=description.strip(),
            )
    return out


def _parse_views(raw: Any, topic_names: set[str], errors: list[str]) -> dict[str, ViewSpec]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        errors.append("views: must be a mapping of view name -> spec")
        return {}
    out: dict[str, ViewSpec] = {}
    for name, spec in raw.items():
        where = f"views.{name}"
        if not isinstance(name, str) or not VIEW_NAME.match(name):
            errors.append(f"{where}: view names are lower_snake_case identifiers")
            continue
        if not isinstance(spec, Mapping):
            errors.append(f"{where}: must be a mapping")
            continue
        ok = True
        unknown = set(spec) - {"description", "topics", "default_version", "versions", "archives", "retention",
                               "trigger"}
        if unknown:
            errors.append(f"{where}: unknown key(s): {', '.join(sorted(map(str, unknown)))}")
        topics = spec.get("topics")
        if not isinstance(topics, list) or not topics or not all(isinstance(t, str) for t in topics):
            errors.append(f"{where}.topics: must be a non-empty list of topic names")
            ok = False
            topics = []
        for i, t in enumerate(topics):
            if t not in topic_names:
                errors.append(
                    f"{where}.topics[{i}]: unknown topic {t!r} (declared: {', '.join(sorted(topic_names))})"
                )
                ok = False
        versions: dict[int, str] = {}
        raw_versions = spec.get("versions")
        if not isinstance(raw_versions, Mapping) or not raw_versions:
            errors.append(f"{where}.versions: must be a non-empty mapping of version number -> {{module: ...}}")
            ok = False
        else:
            for v, vspec in raw_versions.items():
                vnum = _positive_int(v)
                if vnum is None:
                    errors.append(f"{where}.versions.{v}: version keys are integers >= 1")
                    ok = False
                    continue
                module = vspec.get("module") if isinstance(vspec, Mapping) else None
                if not isinstance(module, str) or not _MODULE.match(module):
                    errors.append(f"{where}.versions.{v}.module: must be a dotted module path, got {module!r}")
                    ok = False
                    continue
                versions[vnum] = module
        default = _positive_int(spec.get("default_version"))
        if default is None:
            errors.append(f"{where}.default_version: must be an integer >= 1")
            ok = False
        elif versions and default not in versions:
            errors.append(f"{where}.default_version: {default} is not a declared version ({sorted(versions)})")
            ok = False
        archives = spec.get("archives")
        if archives is not None and archives not in topics:
            errors.append(f"{where}.archives: {archives!r} is not one of the view's topics ({', '.join(topics)})")
            ok = False
        retention_ms = None
        if "retention" in spec:
            retention_ms = parse_retention(spec["retention"])
            if archives is None:
                errors.append(f"{where}.retention: only an archive has a retention of its own (`archives: <topic>`)")
                ok = False
            elif retention_ms == 0:
                errors.append(f"{where}.retention: {spec['retention']!r} is not <n>d, <n>h, <n>m, <n>s or forever")
                ok = False
        trigger_ms = None
        if "trigger" in spec:
            trigger_ms = parse_duration_ms(spec["trigger"])
            if not 0 < trigger_ms <= MAX_TRIGGER_SECONDS * 1000:
                errors.append(f"{where}.trigger: {spec['trigger']!r}: use <n>s or <n>m, at most "
                              f"{MAX_TRIGGER_SECONDS // 60}m (how often the view's live micro-batches run)")
                ok = False
        description = spec.get("description", "")
        if ok and default is not None:
            out[name] = ViewSpec(
                name=name,
                description=str(description).strip(),
                topics=tuple(topics),
                default_version=default,
                versions=dict(sorted(versions.items())),
                archives=archives,
                retention_ms=retention_ms or None,
                trigger_seconds=trigger_ms / 1000 if trigger_ms else None,
            )
    return out
