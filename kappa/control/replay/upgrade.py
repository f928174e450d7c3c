"""Upgrade modes: where a new version starts - replayed from the log, or continued from the serving version.

``replay`` (the default) rebuilds the version from a start in the log into an empty table. ``continue`` (Flink's
stateless upgrade) is for a version whose change only concerns records to come: its table is *seeded* with the
serving version's rows at one Delta version of that table, and its job starts at the end offsets of the
micro-batch that Delta version holds (its lineage, :mod:`kappa.runtime.lineage`), so no record is read twice or
skipped. The mode is declared per version (:attr:`kappa.runtime.view.ViewDefinition.upgrade`) and can be asked
for per replay (``--upgrade`` / the DAG's ``upgrade`` Param); :func:`kappa.runtime.view.continue_refusal` says
where it would give a wrong answer (stateful versions: their state would start empty) and is refused.

The seed is written by the version's own job, once, before its first micro-batch (:func:`kappa.runtime.sink.seed_table`,
an idempotent Delta commit keyed ``<appId>/seed``); the seed's origin is part of the run (``run.json``: ``seed``),
so a restarted driver, the verification and ``kappa status`` all read it from one place. Verification treats the
seed as the table's base: the recompute and the oracle of the version's own range are applied on top of the
serving version's rows at that Delta version (:func:`kappa.control.replay.verification.verify`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kappa.control.registry import RegistryError
from kappa.control.replay.request import ReplayError, ReplayRequest
from kappa.control.replay.version import ViewVersion, alias_of

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = ["continue_point", "upgrade_mode"]


def upgrade_mode(req: ReplayRequest, vv: ViewVersion) -> str:
    """The mode of this replay: the request's, else the one the version declares."""
    return req.upgrade or vv.definition.upgrade


def continue_point(vv: ViewVersion, settings: Settings) -> dict[str, Any]:
    """Where ``vv`` continues from: the serving version's table at its latest Delta version and the end offsets
    of the micro-batch that version holds. JSON-friendly (it goes into ``run.json`` and the preflight).

    Raises:
        ReplayError: Nothing serves, this version serves, the serving version cannot be continued from
            (:func:`kappa.runtime.view.continue_refusal`), or its table holds no micro-batch yet.
    """
    from deltalake import DeltaTable

    from kappa.runtime.view import continue_refusal

    why = continue_refusal(vv.definition, None)
    if why:
        raise ReplayError(f"upgrade=continue refused: {why}")
    try:
        target = alias_of(settings).target(vv.name)
    except RegistryError as exc:
        raise ReplayError(f"upgrade=continue: no serving version of {vv.name} to continue from ({exc})") from None
    if target.version == vv.version:
        raise ReplayError(f"upgrade=continue: {vv.ref} serves already; there is nothing to continue from")
    serving = ViewVersion.resolve(vv.name, target.version, settings)
    why = continue_refusal(vv.definition, serving.definition)
    if why:
        raise ReplayError(f"upgrade=continue refused: {why}")
    if not DeltaTable.is_deltatable(target.table_path):
        raise ReplayError(f"upgrade=continue: {serving.ref} has no table at {target.table_path} to seed from")
    table = DeltaTable(target.table_path)
    app = serving.app_id()
    batch = table.transaction_version(app) if app else None
    if batch is None:
        raise ReplayError(f"upgrade=continue: {serving.ref} has committed no micro-batch yet; replay instead")
    bounds = serving.batch_boundaries(table, app or "", batch)
    if not bounds or bounds[-1].batch_id != batch:
        raise ReplayError(f"upgrade=continue: the end offsets of {serving.ref}'s batch {batch} are neither in its "
                          "Delta history nor in its checkpoint; replay instead")
    return {"from_version": serving.version, "table": target.table_path, "delta_version": table.version(),
            "batch": batch, "app_id": app,
            "end_offsets": {str(p): o for p, o in sorted(bounds[-1].end_offsets.items())}}
