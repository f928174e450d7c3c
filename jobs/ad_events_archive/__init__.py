"""Versions of the `ad_events_archive` view: the lake's archive of the ad-events topic."""
