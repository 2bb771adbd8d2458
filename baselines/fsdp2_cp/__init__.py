"""FSDP2+CP: PyTorch's own ``fully_shard`` folded with context parallelism on the same D ranks
(model.py; costs.py: its closed forms; no decode path)."""

from baselines.fsdp2_cp.model import FSDP2CP

__all__ = ["FSDP2CP"]
