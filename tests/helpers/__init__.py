"""Plumbing the unit and integration tests share."""
