#!/usr/bin/env python3
"""Print the Prometheus metric names the view drivers export, read from kappa/runtime/metrics.py.

Counters are exposed with the ``_total`` suffix, histograms under their base name (``_bucket``/``_sum``/``_count``
series), gauges as named. Used by infra/verify-offline.sh (promql-lint -metrics) and tests/deploy to check that
every alert rule and dashboard query references a metric that exists.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

METRICS_PY = Path(__file__).resolve().parents[2] / "kappa" / "runtime" / "metrics.py"
_DECL = re.compile(r"\b(Counter|Histogram|_BulkHistogram|Gauge|gauge)\(\s*\"(kappa_[a-z0-9_]+)\"")


def exported_metrics(source: str | None = None) -> list[str]:
    text = METRICS_PY.read_text(encoding="utf-8") if source is None else source
    names = set()
    for kind, name in _DECL.findall(text):
        names.add(f"{name}_total" if kind == "Counter" and not name.endswith("_total") else name)
    return sorted(names)


if __name__ == "__main__":
    found = exported_metrics()
    if not found:
        sys.exit(f"no kappa_* metric declarations found in {METRICS_PY}")
    print(",".join(found))
