"""Versions of the `campaign_window_counts` view."""
