"""TP: Megatron tensor parallelism over D ranks (model.py; costs.py: its closed forms;
decode.py: its decode path)."""

from baselines.tp.model import TP

__all__ = ["TP"]
