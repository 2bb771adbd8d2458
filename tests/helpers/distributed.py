"""Spawn one gloo world per test module and run a rank-side function in it.

Each spawned rank pays a torch import, so a module starts one world and runs many checks inside.
The rank-side function is named as ``"module:function"`` and returns a JSON-able value per rank.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, tmp: str, target: str, args: tuple) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=180),
    )
    try:
        mod, fn = target.split(":")
        out = getattr(importlib.import_module(mod), fn)(*args)
        with open(f"{tmp}/rank{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def run_world(world: int, target: str, *args: object) -> list[object]:
    """Run ``target(*args)`` on ``world`` gloo ranks; return each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, (world, tmp, target, args), nprocs=world, start_method="spawn")
        results = []
        for r in range(world):
            with open(f"{tmp}/rank{r}.json") as f:
                results.append(json.load(f))
        return results
