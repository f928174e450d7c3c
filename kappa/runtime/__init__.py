"""The stream runtime: how a view version runs.

``view`` (the definition a view module declares) · ``driver`` (the process a runner starts: one view, or the
view host) · ``job`` (one streaming query per view version) · ``host`` (many in one JVM) · ``parsing`` (decode and
validate in the JVM) · ``plan`` (stateful views: output and bad records from one plan) · ``lookups`` ·
``batch`` (the foreachBatch body) · ``late`` · ``sink`` (idempotent Delta commits) · ``deltars`` (delta-rs
helpers) · ``lineage`` (offsets and watermark in every commit) · ``checkpoint`` (a run's progress, read without
Spark) · ``lock`` · ``metrics`` · ``spark`` · ``repairs`` (a repair's swap, committed by the live job on an
object store) · ``rerun`` (a transform re-run over recorded micro-batches) · ``testing`` (the view authors' kit).
"""

from kappa import lazy_exports

__all__ = ["Expectation", "Finality", "JobSpec", "Lookup", "ViewDefinition", "ViewHost", "ViewJob", "build_spark",
           "declared_view", "load_view", "run_view"]

__getattr__ = lazy_exports(__name__, {
    "Expectation": "kappa.runtime.view",
    "Finality": "kappa.runtime.view",
    "ViewDefinition": "kappa.runtime.view",
    "declared_view": "kappa.runtime.view",
    "load_view": "kappa.runtime.view",
    "JobSpec": "kappa.runtime.driver",
    "Lookup": "kappa.runtime.lookups",
    "ViewHost": "kappa.runtime.host",
    "ViewJob": "kappa.runtime.job",
    "build_spark": "kappa.runtime.spark",
    "run_view": "kappa.runtime.testing",
})
