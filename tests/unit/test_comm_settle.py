"""Gloo marks a collective complete before its worker thread drops the work, and the work holds
what it was handed: a buffer must not die with it, on that thread, at a moment the memory
tracker cannot predict. Gloo is handed aliases that own none of the memory, and
:class:`Pending` keeps the buffers until its wait (tests/integration/test_comm_threads.py runs
real gloo)."""

from __future__ import annotations

import weakref

import torch

from tspbench.core.comm import Pending, _alias


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def test_an_alias_shares_the_memory_and_owns_none_of_it():
    t = torch.arange(6.0).view(2, 3)
    uses, refs = t._use_count(), _storage_refs(t)
    a = _alias(t, flat=True)
    assert a._base is None and a.shape == (6,) and a.data_ptr() == t.data_ptr()
    assert t._use_count() == uses and _storage_refs(t) == refs  # no reference to t or its storage
    a.add_(1)
    assert t.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    b = _alias(t[:, 1:], flat=False)  # any strided layout, at its offset
    assert b.shape == (2, 2) and b.stride() == (3, 1) and b.tolist() == [[2.0, 3.0], [5.0, 6.0]]


def test_pending_keeps_the_buffers_until_its_wait():
    buf = torch.zeros(1024)
    gone = weakref.ref(buf)
    pending = Pending([], lambda: None, keep=[buf])
    del buf
    assert gone() is not None  # the backend works on the memory through an alias only
    pending.wait()
    assert gone() is None


def test_a_flat_alias_of_a_strided_tensor_is_refused():
    t = torch.arange(8.0).view(2, 4)
    try:
        _alias(t[:, :2], flat=True)  # 1-D over its memory would be elements 0-3, not 0,1,4,5
    except ValueError as e:
        assert "contiguous" in str(e)
    else:
        raise AssertionError("a strided tensor was flattened over its memory")
