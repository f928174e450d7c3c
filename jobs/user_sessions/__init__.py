"""Versions of the `user_sessions` view."""
