"""A file system that fills up during a run (a real tmpfs, mounted small): the record cannot be
written, and the run says so in one line per process with the status it would have had, exits
1, and leaves nothing half-written. Needs permission to mount (root in a container); skipped
otherwise."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.runner import tspbench


@pytest.fixture
def full_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)],
                       capture_output=True)  # fmt: skip
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")
    try:
        (mnt / "fill").write_bytes(b"x" * 16384 * 2)
    except OSError:  # full: what the test needs (empty files still fit: --out's probe passes)
        pass
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_at_the_end_is_one_line_and_no_partial_record(full_disk):
    out = full_disk / "r.json"
    p = tspbench("run", "--model", "tiny", "--seq-len", "64", "--strategy", "tsp", "--degree",
                 "2", "--steps", "1", "--warmup", "0", "--quiet", "--launch", "local", "--nproc",
                 "2", "--out", str(out))  # fmt: skip
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0] == (
        f"tspbench: error: rank 0: cannot write the record '{out}' (No space left on device); "
        "its status was ok"
    ), lines
    assert all("No space left on device" in x for x in lines) and len(lines) <= 2, lines
    assert sorted(x.name for x in full_disk.iterdir()) == ["fill"]  # no record, no temp file
