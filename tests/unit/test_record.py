"""Records on a shared file system: readable by the group (the umask decides, not mkstemp's
0600), strict JSON, and an allocator failure classified as an OOM (a FIFO where a record should
be: tests/integration/test_cli.py)."""

from __future__ import annotations

import os
import stat

import pytest

from tspbench.runtime.failure import classify
from tspbench.runtime.record import write_json


def test_records_get_the_permissions_an_ordinary_write_would(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "r.json", {"status": "ok"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o644


def test_non_finite_numbers_are_never_written(tmp_path):
    with pytest.raises(ValueError):
        write_json(tmp_path / "r.json", {"loss": float("nan")})
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    "error, status",
    [
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"),
            "oom",
        ),
        (MemoryError(), "oom"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (RuntimeError("injected fault"), "error"),
    ],
)
def test_an_allocator_failure_is_an_oom_not_an_error(error, status):
    assert classify(error) == status
