"""DP, and ``single``: DP on one rank, the reference every strategy is checked on (model.py;
costs.py: their closed forms; decode.py: the reference's decode path). One folder, two
registered strategies: single is DP at degree 1, and no strategy may import another."""

from baselines.dp.model import DP, Single

__all__ = ["DP", "Single"]
