"""A view version resolved once: the names, code, topic, paths and run identity every replay step needs.

``ViewVersion.resolve(view, version, settings)`` checks the declaration (``platform.yaml``, or
``$KAPPA_PLATFORM``) and loads the version's module once; the steps then pass the value along instead of
re-deriving paths, topic, module, run id and Delta appId from strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kappa.runtime.checkpoint import checkpoint_batches, current_run_id, last_commit, open_run, pending_watermark, run_info
from kappa.runtime.deltars import local_path
from kappa.identity import ViewPaths, app_id, view_ref
from kappa.runtime.lineage import batches_from_history
from kappa.control.registry import Registry, VersionRecord
from kappa.control.replay.request import ReplayError

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.runtime.lineage import BatchBoundary
    from kappa.control.serving import ServingAlias
    from kappa.runtime.view import ViewDefinition

__all__ = ["ViewVersion", "alias_of", "committed_offsets", "module_of", "new_version", "registry_of", "run_app_id",
           "stream_topic"]


def module_of(view: str, version: int) -> str:
    """Module of a declared view version, or a one-line ReplayError naming what is declared."""
    from kappa.catalog import UnknownView, load_catalog

    try:
        return load_catalog().module_of(view, version)
    except UnknownView as exc:
        raise ReplayError(str(exc)) from None


def new_version(view: str) -> str:
    """What a hint says when a change needs a version of its own: the next number the declarations do not use
    (``version + 1`` may already be declared, with other code)."""
    from kappa.catalog import UnknownView, load_catalog

    try:
        catalog = load_catalog()
        spec = catalog.view(view)
    except UnknownView as exc:
        raise ReplayError(str(exc)) from None
    n = max(spec.versions) + 1
    from kappa.config import PLATFORM_FILE

    where = ("kappa/platform.yaml" if catalog.source is None or Path(catalog.source) == PLATFORM_FILE
             else str(catalog.source))
    return f"a new version: declare {view} v{n} in {where} (its module, e.g. jobs/{view}/v{n}.py)"


def stream_topic(view: str, version: int) -> str:
    """The declared topic a view version streams from (its ``ViewDefinition.stream_topic``)."""
    from kappa.runtime.view import load_view

    return load_view(module_of(view, version)).stream_topic


def registry_of(settings: Settings) -> Registry:
    return Registry(settings.lake_uri)


def alias_of(settings: Settings) -> ServingAlias:
    from kappa.control.serving import ServingAlias

    return ServingAlias(settings.lake_uri)


def committed_offsets(settings: Settings, view: str, version: int, topic: str) -> tuple[dict[int, int], int | None]:
    """End offsets of the last *committed* micro-batch of the view version's main query (and its id)."""
    return last_commit(f"{ViewPaths(settings.lake_uri, view, version).checkpoint}/main", topic)


def run_app_id(settings: Settings, view: str, version: int) -> str | None:
    """Delta appId of the version's run: from the table's run id, else the checkpoint's run.json."""
    return ViewVersion.resolve(view, version, settings).app_id()


@dataclass(frozen=True)
class ViewVersion:
    """One declared version of one view, resolved once.

    Attributes:
        name: View name.
        version: Version number.
        module: Module implementing it (``VIEW = ViewDefinition(...)``).
        stream_topic: The declared topic it streams from.
        topic: The physical Kafka topic (``KAPPA_TOPIC_PREFIX`` applied).
        paths: Its table, checkpoint, staging table and the shared quarantine (:class:`kappa.runtime.job.ViewPaths`).
        settings: The platform settings it was resolved with.
    """

    name: str
    version: int
    module: str
    stream_topic: str
    topic: str
    paths: ViewPaths
    settings: Settings = field(repr=False, compare=False)

    @classmethod
    def resolve(cls, view: str, version: int, settings: Settings) -> ViewVersion:
        """Check the declaration and load the module once.

        Raises:
            ReplayError: Unknown view or version (one line naming what is declared).
        """
        from kappa.runtime.view import load_view

        module = module_of(view, version)
        declared = load_view(module).stream_topic
        return cls(name=view, version=version, module=module, stream_topic=declared,
                   topic=settings.topic(declared), paths=ViewPaths(settings.lake_uri, view, version),
                   settings=settings)

    @property
    def ref(self) -> str:
        """``<view>@v<N>``."""
        return view_ref(self.name, self.version)

    @property
    def definition(self) -> ViewDefinition:
        """The version's :class:`kappa.runtime.view.ViewDefinition` (its transform, keys, expectations...)."""
        from kappa.runtime.view import load_view

        return load_view(self.module)

    # run identity ------------------------------------------------------------------------------------
    def run_info(self) -> dict[str, Any]:
        """The checkpoint's ``run.json`` (run id, start and target offsets; empty before the first run)."""
        return run_info(self.paths.checkpoint)

    def app_id(self) -> str | None:
        """Delta appId of the version's run (:func:`kappa.runtime.checkpoint.current_run_id`); None before any."""
        run = current_run_id(self.paths)
        return app_id(self.name, self.version, run) if run else None

    def ensure_run_id(self, record: VersionRecord | None, *, seed: Mapping[str, Any] | None = None,
                      archive: Mapping[str, Any] | None = None) -> str:
        """The run id the version's job will use, recorded in its checkpoint (``run.json``) before the job starts,
        so the registry row carries the exact Delta appId from the start
        (:func:`kappa.runtime.checkpoint.open_run`; a registered run keeps its id). ``seed``: the run continues
        from the serving version (:mod:`kappa.control.replay.upgrade`); its job seeds the table from it.
        ``archive``: the run starts in the topic's archive (:attr:`kappa.control.replay.planning.Preflight.archive`);
        its job reads that part from there first."""
        known = current_run_id(self.paths)
        if known:
            if seed is not None and self.run_info().get("seed") != dict(seed):
                raise ReplayError(f"{self.ref} already has a run that was not continued from this point "
                                  f"(v{seed.get('from_version')} at Delta version {seed.get('delta_version')}); "
                                  "one version has one start")
            return known
        registered = record.app_id.rsplit(":", 1)[-1] if record is not None else None
        fields: dict[str, Any] = {"created_by": "kappa.control.replay"}
        if seed is not None:
            fields["seed"] = dict(seed)
        if archive is not None:
            fields["archive"] = dict(archive)
        return open_run(self.paths, run_id=None if registered in (None, "pending") else registered,
                        **fields)["run_id"]

    def committed_offsets(self) -> tuple[dict[int, int], int | None]:
        """End offsets of the last committed micro-batch of its query (and the batch id)."""
        return last_commit(f"{self.paths.checkpoint}/main", self.topic)

    def pending_watermark(self) -> tuple[int, int] | None:
        """(watermark of the last committed batch, the later one it set for the next) when output is still owed
        (:func:`kappa.runtime.checkpoint.pending_watermark`)."""
        return pending_watermark(f"{self.paths.checkpoint}/main")

    # what its Delta commits recorded -----------------------------------------------------------------
    def run_commits(self, table: Any) -> list[dict[str, Any]]:
        """Commit infos of its table (a delta-rs ``DeltaTable``) and of its staging table (bulk catch-up)."""
        from deltalake import DeltaTable

        commits = list(table.history())
        if DeltaTable.is_deltatable(self.paths.staging):
            commits += DeltaTable(self.paths.staging).history()
        return commits

    def batch_boundaries(self, table: Any, app_id: str, upto: int) -> list[BatchBoundary]:
        """Every batch boundary of the run up to ``upto``: from the Delta commits (:mod:`kappa.runtime.lineage`, complete
        for the table's history; batches of a bulk catch-up are commits of the run's staging table), else from
        the checkpoint (only its last ``minBatchesToRetain`` batches)."""
        history = batches_from_history(self.run_commits(table), app_id, upto=upto)
        if [b.batch_id for b in history] == list(range(upto + 1)):
            return history
        merged = {b.batch_id: b for b in checkpoint_batches(f"{self.paths.checkpoint}/main", self.topic, upto=upto)}
        merged.update({b.batch_id: b for b in history})
        return [merged[b] for b in sorted(merged)]

    def report_dir(self) -> Path:
        """Where its reports go: ``views/<view>/v<N>/reports`` on a local lake, else under ``$KAPPA_HOME``."""
        if self.paths.is_local:
            return Path(local_path(self.paths.root)) / "reports"
        return Path(self.settings.home) / "reports" / self.name / f"v{self.version}"
