"""Versions of the `campaign_catalog` view."""
