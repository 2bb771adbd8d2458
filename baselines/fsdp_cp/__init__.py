"""FSDP+CP: fully sharded weights folded with context parallelism on the same D ranks
(model.py; costs.py: its closed forms; no decode path)."""

from baselines.fsdp_cp.model import FSDPCP

__all__ = ["FSDPCP"]
