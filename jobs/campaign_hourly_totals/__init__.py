"""Versions of the `campaign_hourly_totals` view (a view over `campaign_window_counts`)."""
