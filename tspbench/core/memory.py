"""Peak live tensor bytes on any device, including fake tensors: a TorchDispatchMode tracker.

Every tensor an op returns is recorded by its storage (views share one), and forgotten when that
storage is freed, so ``peak`` is the high-water mark of live storage bytes created under the
mode plus what was registered with :meth:`track`. With ``limit`` set, exceeding it raises
:class:`TrackedOOM`: a testable stand-in for a device OOM on CPU.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class TrackedOOM(torch.OutOfMemoryError):
    """Raised when tracked live bytes exceed the tracker's limit."""


class MemoryTracker(TorchDispatchMode):
    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _free(self, n: int) -> None:
        self.live -= n

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._seen:
            return
        n = st.nbytes()
        self._seen[st] = n
        weakref.finalize(st, self._free, n)
        self.live += n
        if self.live > self.peak:
            self.peak = self.live
        if self.limit is not None and self.live > self.limit:
            raise TrackedOOM(
                f"tracked live tensor bytes {self.live} exceed the budget {self.limit}"
            )

    def track(self, *objs: object) -> None:
        """Register tensors created outside the mode (parameters, inputs)."""
        for t in tree_leaves(list(objs)):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
