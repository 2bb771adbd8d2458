"""SP: context parallelism with replicated weights (model.py; costs.py: its closed forms;
decode.py: its decode path)."""

from baselines.sp.model import SP

__all__ = ["SP"]
