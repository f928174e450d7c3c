"""Versions of the `events_raw` view."""
