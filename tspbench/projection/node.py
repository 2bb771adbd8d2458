"""A cell's share of its node: the CPUs, host memory and exclusivity a Slurm job asks for.

One core per GPU rank (the old default) is shared by the Python process, the NCCL/RCCL proxy
threads and torch's watchdog; a rank that builds its shards and feeds its GPU wants its share of
the node's cores. So a rank asks for ``cpus // gpus_per_node`` CPUs, a job for the fraction of
the node's memory that its GPUs are of the node's (less :data:`HOST_RESERVE` for the system), and
a job that fills its nodes asks for them whole (``--exclusive``: no other job's NIC traffic or
page cache beside it). The node facts come with the hardware preset (``node`` in
hardware.json, with sources); a site whose nodes differ states its own in the sweep config.
"""

from __future__ import annotations

import math

HOST_RESERVE = 0.1  # of a node's memory, left to the system (page cache, daemons, file systems)


def node_share(preset: dict, gpus_per_node: int, ranks_here: int) -> dict:
    """``cpus_per_task``, ``mem_mb`` (per node) and ``exclusive`` for a job that runs
    ``ranks_here`` ranks on each of its nodes of ``gpus_per_node`` GPUs of ``preset``; ValueError
    naming the preset when it states no node."""
    node = preset.get("node")
    if not node:
        raise ValueError(f"hardware preset {preset.get('name')!r} states no node (cpus, memory)")
    share = ranks_here / gpus_per_node
    return {
        "cpus_per_task": max(1, node["cpus"] // gpus_per_node),
        "mem_mb": math.floor(node["memory_bytes"] * (1 - HOST_RESERVE) * share / 2**20),
        "exclusive": ranks_here >= gpus_per_node,
    }
