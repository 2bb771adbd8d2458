"""Shared core: everything a strategy may import. Nothing here imports a strategy or the harness."""
