"""Peak live tensor bytes on any device, including fake tensors: a TorchDispatchMode tracker.

Every tensor an op returns is recorded by its storage (views share one; a wrapper subclass, such
as a DTensor, by its inner tensors: its own storage holds no data), and forgotten when that
storage is freed, so ``peak`` is the high-water mark of live storage bytes created under the
mode plus what was registered with :meth:`track` or :func:`charge`. A recorded storage that is
resized in place (``UntypedStorage.resize_``, which no dispatch mode sees: FSDP2 frees a gathered
parameter by resizing its storage to 0 and re-allocates it the same way) counts at its new size.
With ``limit`` set, exceeding it raises :class:`TrackedOOM`: a testable stand-in for a device OOM
on CPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class TrackedOOM(torch.OutOfMemoryError):
    """Raised when tracked live bytes exceed the tracker's limit."""


_active: list[MemoryTracker] = []  # entered trackers, which storage resizes are reported to
_resize = torch.UntypedStorage.resize_


def charge(nbytes: int) -> Callable[[], None]:
    """Count a buffer of ``nbytes`` that a library holds beyond what its dispatched ops show (a
    collective backend's staging buffer) in every entered tracker, until the returned function
    is called. Over a budget, raises as an allocation would."""
    trackers = list(_active)

    def release() -> None:
        for t in trackers:
            t.live -= nbytes
            t.staged -= nbytes

    for t in trackers:
        t.staged += nbytes
    over = [t for t in trackers if t._grow(nbytes)]
    if over:
        release()
        over[0]._raise()
    return release


@contextmanager
def unrecorded() -> Iterator[None]:
    """Ops dispatched inside are not recorded by the entered trackers: for a library call whose
    outputs are buffers counted by :func:`charge` (or the caller's own, already counted)."""
    trackers = list(_active)
    for t in trackers:
        t._paused += 1
    try:
        yield
    finally:
        for t in trackers:
            t._paused -= 1


def _resize_seen(storage: torch.UntypedStorage, size: int):
    """``UntypedStorage.resize_``, reported to every entered tracker (each is told before any
    raises over its budget)."""
    before = storage.nbytes()
    out = _resize(storage, size)
    over = [t for t in _active if t._resized(storage, before)]
    if over:
        over[0]._raise()
    return out


REST = "activations and temporaries"
STAGING = "collective staging"


class MemoryTracker(TorchDispatchMode):
    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.live = 0
        self.peak = 0
        self.staged = 0  # of live: buffers counted by :func:`charge`
        # the high-water mark of live - staged: the peak of the same ops on a backend that
        # stages nothing in torch's allocator (NCCL), from the same step
        self.peak_unstaged = 0
        self._crest: int | None = None
        self._on_crest: Callable[[], None] | None = None
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [its bytes]
        self._paused = 0  # inside :func:`unrecorded`

    def __enter__(self) -> MemoryTracker:
        if self in _active:
            raise RuntimeError("a MemoryTracker is entered once at a time (resizes count once)")
        out = super().__enter__()
        if not _active:
            torch.UntypedStorage.resize_ = _resize_seen  # type: ignore[method-assign,assignment]
        _active.append(self)
        return out

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _active.remove(self)
            if not _active:
                torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]

    def _free(self, size: list[int]) -> None:
        self.live -= size[0]

    def _grow(self, n: int) -> bool:
        """Count ``n`` more live bytes; True where that exceeds the budget."""
        self.live += n
        if self.live > self.peak:
            self.peak = self.live
        if self.live - self.staged > self.peak_unstaged:
            self.peak_unstaged = self.live - self.staged
        if self._crest is not None and self.live >= self._crest and self._on_crest:
            self._crest = None
            self._paused += 1
            try:
                self._on_crest()
            finally:
                self._paused -= 1
        return self.limit is not None and self.live > self.limit

    def _raise(self) -> None:
        raise TrackedOOM(f"tracked live tensor bytes {self.live} exceed the budget {self.limit}")

    def _add(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # (a DTensor, an AsyncCollectiveTensor) holds no
            for name in t.__tensor_flatten__()[0]:  # memory of its own: its inner tensors do
                self._add(getattr(t, name))
            return
        st = t.untyped_storage()
        if st in self._seen:
            return
        if self._record(st, st.nbytes()):
            self._raise()

    def _record(self, st: torch.UntypedStorage, n: int) -> bool:
        size = [n]
        self._seen[st] = size
        weakref.finalize(st, self._free, size)
        return self._grow(n)

    def _resized(self, st: torch.UntypedStorage, before: int) -> bool:
        """Count a resize of ``st``: a recorded storage at its new size; one made before this
        tracker once it is allocated again from nothing (FSDP2 re-gathering a parameter it
        freed before the tracker began); True where that exceeds the budget."""
        size = self._seen.get(st)
        if size is None:
            return before == 0 and st.nbytes() > 0 and self._record(st, st.nbytes())
        n, size[0] = size[0], st.nbytes()
        return self._grow(size[0] - n)

    def track(self, *objs: object) -> None:
        """Register tensors created outside the mode (parameters, inputs)."""
        for t in tree_leaves(list(objs)):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def crest(self, nbytes: int, then: Callable[[], None]) -> None:
        """Call ``then()`` (once, recording paused) when live bytes first reach ``nbytes``: to
        see what is live at a known peak (:meth:`live_by`)."""
        self._crest, self._on_crest = nbytes, then

    def live_by(self, groups: dict[str, object]) -> dict[str, int]:
        """Live bytes now, by part: each storage in the first of ``groups`` (name: tensors, in
        any nesting) that holds a tensor on it, else :data:`REST`; :data:`STAGING` for what
        :func:`charge` counts. The parts add up to ``live``."""
        owner: dict[int, str] = {}
        for name, tensors in groups.items():
            for t in tree_leaves(tensors):
                if isinstance(t, torch.Tensor):
                    owner.setdefault(t.untyped_storage()._cdata, name)
        parts = dict.fromkeys([*groups, STAGING, REST], 0)
        for st, size in list(self._seen.items()):
            parts[owner.get(st._cdata, REST)] += size[0]
        parts[STAGING] = self.staged
        return parts

    def reset_peak(self) -> None:
        self.peak = self.live
        self.peak_unstaged = self.live - self.staged

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
