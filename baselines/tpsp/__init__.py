"""TP+SP: Megatron TP inside a T x Sigma mesh, context parallelism across (model.py; costs.py:
its closed forms; decode.py: its decode path)."""

from baselines.tpsp.model import TPSP

__all__ = ["TPSP"]
