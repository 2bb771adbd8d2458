"""The failure path reads the peers' causes from the job's store; that store lives in rank 0's
process, which leaves as soon as it has written the record. A rank still reading must get what
was posted so far, never an exception (CI once saw rank 0's own read fail with DistNetworkError
and the OOM record of `test_forced_oom_is_a_result` turn into a crash)."""

import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from tspbench.runtime.failure import FAIL_KEY, TRACEBACK_KEY, causes, traceback_of
from tspbench.runtime.launch import free_port

HOST = """
import sys, time
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, wait_for_workers=False)
s.set("{tb}", "Traceback (most recent call last):\\n  ...\\nTrackedOOM\\n")
s.set("{key}", "oom\\tTrackedOOM: tracked live tensor bytes 2 exceed the budget 1")
print("up", flush=True)
time.sleep(60)
"""


def test_causes_survive_the_store_host_leaving(monkeypatch):
    port = free_port()
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOST.format(key=FAIL_KEY.format(1), tb=TRACEBACK_KEY.format(1)),
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout.readline().strip() == "up"
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=5))
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
        found = causes(2, wait_s=1.0)
        assert found == {1: ("oom", "TrackedOOM: tracked live tensor bytes 2 exceed the budget 1")}
        # rank 0 prints the root cause's traceback once: rank 1's from the store, or its own
        assert traceback_of(1, 0).endswith("TrackedOOM\n") and traceback_of(0, 0, "mine") == "mine"
        assert traceback_of(2, 0) == ""  # posted none
        host.kill()  # rank 0 wrote the record and left
        host.wait()
        t = time.monotonic()
        assert causes(2, wait_s=1.0) == {} and traceback_of(1, 0) == ""
        assert time.monotonic() - t < 5.0
    finally:
        host.kill()
        host.wait()
