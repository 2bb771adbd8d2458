"""TSP: folded tensor and sequence parallelism on one device axis of size D (method doc)."""

from tsp_impl.model import TSP

__all__ = ["TSP"]
