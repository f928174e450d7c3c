"""campaign_hourly_totals v2 - v1's logic over campaign_window_counts v2 (60 s windows, ``campaign-windows.v2``).

Built by a cascading replay of campaign_window_counts v2 and switched with it (docs/replay.md "Views of views").
"""

from __future__ import annotations

from jobs.campaign_hourly_totals.v1 import over

VIEW = over(2, version=2)
