"""Verification: is a view version's table what it should be?

``compare`` (a table against expected rows: by key or as a multiset) · ``recompute`` (the version's own transform
re-run over exactly the micro-batches its table holds) · ``oracle`` (a plain-Python twin of the shipped views,
from the raw Kafka records) · ``diffreport`` (a new version against the serving one, JSON + PNG).
"""

from kappa import lazy_exports

__all__ = ["Check", "DiffReport", "compare", "diff_report", "recompute"]

__getattr__ = lazy_exports(__name__, {
    "Check": "kappa.verify.compare",
    "compare": "kappa.verify.compare",
    "recompute": "kappa.verify.recompute",
    "DiffReport": "kappa.verify.diffreport",
    "diff_report": "kappa.verify.diffreport",
})
