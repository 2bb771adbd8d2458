"""TSP: folded tensor and sequence parallelism on one device axis of size D (``docs/method.md``)."""

from tsp_impl.model import TSP

__all__ = ["TSP"]
