"""Views of views: the dependency graph of the declared view versions, and cascading replays.

A view version that declares ``publish`` (:class:`kappa.runtime.view.Publish`) writes rows of its table to a
topic of its own (:mod:`kappa.runtime.publish`); a version whose ``stream_topic`` is that topic is *over* it.
The graph is read from the declarations alone (``platform.yaml`` and each version's ``ViewDefinition``): one
:class:`Edge` per (publishing version, reading version). ``kappa views`` prints it.

A **cascading replay** of ``view@vN`` (``kappa replay <view> --version N --cascade``, the DAG's ``cascade`` Param)
builds, beside ``vN``, every dependant against it: for each view with a version over any version of ``view``, its
declared version over ``vN`` (recursively, for views over those). Each is a replay of its own (registry row,
lease, checkpoint, strict verification) from the earliest offset of the topic ``vN`` publishes; the dependants are
caught up once ``vN`` has published what it committed when it caught up and they have read all of it. Then one
alias commit switches readers to the whole chain (:meth:`kappa.control.serving.ServingAlias.promote_chain`), and a
rollback with ``cascade`` switches the chain back the same way (:func:`rollback_targets`).

A dependant with no version over ``vN`` is refused before anything starts, naming the line to declare.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from kappa.identity import view_ref
from kappa.control.replay.following import CatchUp, caught_up
from kappa.control.replay.request import ReplayError, ReplayRequest
from kappa.control.replay.version import ViewVersion, alias_of, registry_of

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.control.registry import VersionRecord
    from kappa.control.runners.base import Runner

__all__ = ["Edge", "chain", "chain_caught_up", "dependant_request", "follow_chain", "graph", "graph_problems",
           "launch_chain", "rollback_targets", "table_version", "upstream_of"]

log = logging.getLogger("kappa.control.replay.cascade")


@dataclass(frozen=True, slots=True)
class Edge:
    """``view@v<version>`` reads ``topic``, which ``upstream@v<upstream_version>`` publishes."""

    upstream: str
    upstream_version: int
    topic: str
    view: str
    version: int

    def __str__(self) -> str:
        upstream = view_ref(self.upstream, self.upstream_version)
        return f"{view_ref(self.view, self.version)} <- {self.topic} <- {upstream}"


def _definitions(catalog: Any = None) -> dict[tuple[str, int], Any]:
    from kappa.catalog import load_catalog
    from kappa.runtime.view import load_view

    cat = catalog or load_catalog()
    return {(name, v): load_view(module) for name, spec in cat.views.items() for v, module in spec.versions.items()}


def graph(catalog: Any = None) -> list[Edge]:
    """Every edge of the declared views (see the module docstring), upstream view and versions in order."""
    defs = _definitions(catalog)
    publishers = {d.publish.topic: key for key, d in defs.items() if d.publish is not None}
    edges = [Edge(*publishers[d.stream_topic], d.stream_topic, *key)
             for key, d in defs.items() if d.stream_topic in publishers]
    return sorted(edges, key=lambda e: (e.upstream, e.upstream_version, e.view, e.version))


def graph_problems(catalog: Any = None) -> list[str]:
    """What is wrong with the declared graph: a published topic ``platform.yaml`` does not declare, two versions
    publishing to one topic, a view reading its own output (a cycle)."""
    from kappa.catalog import load_catalog

    cat = catalog or load_catalog()
    defs = _definitions(cat)
    problems, owner = [], {}
    for key, d in defs.items():
        if d.publish is None:
            continue
        if d.publish.topic not in cat.topics:
            problems.append(f"{view_ref(*key)} publishes to {d.publish.topic}, which platform.yaml does not declare")
        if d.publish.topic in owner:
            problems.append(f"{view_ref(*key)} and {view_ref(*owner[d.publish.topic])} both publish to "
                            f"{d.publish.topic} (one topic per publishing version)")
        owner[d.publish.topic] = key
    over = {(e.view, e.version): (e.upstream, e.upstream_version) for e in graph(cat)}
    for start in over:
        seen, node = {start}, over[start]
        while node in over:
            if node in seen:
                problems.append(f"{view_ref(*start)} reads its own output through {view_ref(*node)} (a cycle)")
                break
            seen.add(node)
            node = over[node]
    return problems


def upstream_of(view: str, version: int) -> Edge | None:
    """The edge a view version reads through (None: it reads a topic no view publishes)."""
    return next((e for e in graph() if (e.view, e.version) == (view, version)), None)


def _walk(view: str, version: int, edges: list[Edge],
          pick: Callable[[str, str, int, set[int]], int | None]) -> list[tuple[str, int]]:
    """The views over ``view@v<version>``, upstream first, recursively: for each view with a version over any
    version of the upstream, ``pick(dependant, upstream, upstream version, its versions over that one)`` chooses
    its version (None: leave it out)."""
    out: list[tuple[str, int]] = []
    todo = [(view, version)]
    while todo:
        up, up_version = todo.pop(0)
        for dependant in sorted({e.view for e in edges if e.upstream == up}):
            over = {e.version for e in edges
                    if e.view == dependant and (e.upstream, e.upstream_version) == (up, up_version)}
            chosen = pick(dependant, up, up_version, over)
            if chosen is not None:
                out.append((dependant, chosen))
                todo.append((dependant, chosen))
    return out


def chain(view: str, version: int) -> list[tuple[str, int]]:
    """The dependants a cascading replay of ``view@v<version>`` builds, upstream first: for each view with a
    version over any version of ``view``, its (highest) declared version over ``version``; recursively.

    Raises:
        ReplayError: ``view`` has no dependants, or one declares no version over ``version`` (one line).
    """
    edges = graph()

    def highest(dependant: str, up: str, up_version: int, over: set[int]) -> int:
        if not over:
            from kappa.runtime.view import declared_view

            publish = declared_view(up, up_version).publish
            published = publish.topic if publish is not None else None
            reads = ", ".join(sorted({e.topic for e in edges if e.view == dependant}))
            ref = view_ref(up, up_version)
            raise ReplayError(
                f"{dependant} reads {up} ({reads}) but "
                + (f"declares no version over {ref} (its topic {published}): declare one in platform.yaml"
                   if published else f"{ref} publishes nothing: declare its publish topic and a {dependant} "
                   "version reading it")
                + ", or replay without cascade")
        return max(over)

    out = _walk(view, version, edges, highest)
    if not out:
        from kappa.config import Settings

        raise ReplayError(f"cascade: no view reads what {view} publishes (`{Settings.from_env().cli} views` shows "
                          "the graph)")
    return out


def dependant_request(req: ReplayRequest, view: str, version: int) -> ReplayRequest:
    """The replay of one dependant in a cascade of ``req``: from the earliest offset of the topic it reads, live,
    with the cascade's verification, promotion and keep (its lag counts published rows: it must read all)."""
    return replace(req, view=view, version=version, start="earliest", start_timestamp_ms=None, start_offsets=None,
                   upgrade="replay", max_offsets_per_trigger=None, max_lag=0, metrics_port=None,
                   cascade=False).validate()


def launch_chain(req: ReplayRequest, settings: Settings, runner: Runner) -> list[VersionRecord]:
    """Preflight and launch every dependant of ``req``'s cascade (idempotent, like :func:`launch`); their topics
    are created first when missing (the upstream's job creates its own when it starts)."""
    import dataclasses

    from kappa.catalog import load_catalog
    from kappa.control.replay.launching import launch
    from kappa.control.replay.planning import preflight
    from kappa.log.topics import ensure_topics

    cat = load_catalog()
    records = []
    for view, version in chain(req.view, req.version):
        vv = ViewVersion.resolve(view, version, settings)
        ensure_topics(settings, [dataclasses.replace(cat.topic(vv.stream_topic), name=vv.topic)])
        dreq = dependant_request(req, view, version)
        records.append(launch(dreq, settings, runner, preflight(dreq, settings, runner, resume=True)))
    return records


def chain_caught_up(req: ReplayRequest, settings: Settings, runner: Runner, *, published: int) -> CatchUp:
    """Whether every dependant of the cascade has caught up: each upstream in the chain has published its table
    through Delta version ``published`` (for ``req``'s view: the version it held when it caught up; further down,
    whatever the upstream holds now) and each dependant has read everything its topic holds."""
    from kappa.runtime.publish import published_through

    target = {(req.view, req.version): published}
    for view, version in chain(req.view, req.version):
        edge = upstream_of(view, version)
        if edge is None:  # chain() lists only versions over a publisher: the declarations changed meanwhile
            raise ReplayError(f"{view_ref(view, version)} no longer reads what a view publishes "
                              f"(`{settings.cli} views`)")
        up = ViewVersion.resolve(edge.upstream, edge.upstream_version, settings)
        goal = target.get((up.name, up.version))
        if goal is None:
            goal = table_version(up)
        done = published_through(up.paths.checkpoint)
        if done < goal:
            return CatchUp(False, f"{up.ref} has published its table through Delta version {done} of {goal}")
        caught = caught_up(view, version, settings, runner, by=req.triggered_by, max_lag=0)
        if not caught:
            return CatchUp(False, f"{view_ref(view, version)}: {caught.reason}")
        target[(view, version)] = table_version(ViewVersion.resolve(view, version, settings))
    return CatchUp(True, "every view over it has read what it published")


def table_version(vv: ViewVersion) -> int:
    """The latest Delta version of a view version's table (-1: no table yet)."""
    from deltalake import DeltaTable

    from kappa.runtime.deltars import rs_uri

    uri = rs_uri(vv.paths.table)
    return DeltaTable(uri).version() if DeltaTable.is_deltatable(uri) else -1


def follow_chain(req: ReplayRequest, settings: Settings, runner: Runner, *, published: int, timeout: float = 0.0,
                 poll: float = 2.0, on_wait: Callable[[str], None] | None = None) -> CatchUp:
    """Wait for :func:`chain_caught_up` (``timeout`` 0: no limit), handing each reason to ``on_wait``."""
    deadline = time.monotonic() + timeout if timeout else None
    last = ""
    while True:
        caught = chain_caught_up(req, settings, runner, published=published)
        if caught:
            return caught
        if on_wait is not None and caught.reason != last:
            on_wait(caught.reason)
        last = caught.reason
        if deadline is not None and time.monotonic() > deadline:
            raise ReplayError(f"the views over {req.ref} have not caught up after {timeout:.0f}s ({caught.reason})")
        time.sleep(poll)


def rollback_targets(view: str, to_version: int, settings: Settings) -> list[tuple[str, int]]:
    """The versions a rollback of ``view`` to ``to_version`` with cascade switches the views over it to: for each
    view whose serving version reads what ``view`` publishes, its kept version over ``to_version`` (the one it
    served before, when that reads it; else the highest kept one); recursively.

    Raises:
        ReplayError: A dependant has no kept version over ``to_version`` (one line: rebuild it instead).
    """
    alias, registry = alias_of(settings), registry_of(settings)
    edges = graph()

    def kept_one(dependant: str, up: str, up_version: int, over: set[int]) -> int | None:
        serving = alias.target(dependant).version
        if not any((e.view, e.version) == (dependant, serving) and e.upstream == up for e in edges):
            return None  # what serves does not read this view
        kept = {r.version for r in registry.list(dependant)
                if r.version in over and r.deleted_at is None and r.state in {"retired", "serving"}}
        if not kept:
            raise ReplayError(f"{dependant} has no kept version over {view_ref(up, up_version)}: rebuild one with "
                              f"`{settings.cli} replay {up} --version {up_version} --cascade`, or roll back without "
                              "cascade")
        row = alias.alias(dependant)
        previous = row.previous_version if row is not None else None
        return previous if previous in kept else max(kept)

    return _walk(view, to_version, edges, kept_one)
