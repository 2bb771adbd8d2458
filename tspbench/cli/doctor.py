"""``tspbench doctor``: check this node (GPU or CPU) before a sweep; argument handling only."""

from __future__ import annotations

import argparse
from pathlib import Path

from tspbench.cli.args import out_dir


def cmd_doctor(args: argparse.Namespace) -> int:
    from tspbench.core.compat import require_torch
    from tspbench.pipeline.doctor import doctor

    require_torch()
    out = Path(args.out) if args.out else None
    checks = doctor(out)
    failed = [c.name for c in checks if c.status == "FAILED"]
    ran = sum(c.status != "skipped" for c in checks)
    print(f"{ran - len(failed)} ok, {len(failed)} failed, {len(checks) - ran} skipped")
    return 1 if failed else 0


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from tspbench.core.compat import require_torch
    from tspbench.pipeline.gpucheck import gpu_check

    require_torch()
    return 1 if gpu_check(Path(args.out)) else 0


def add_parsers(sub) -> None:
    d = sub.add_parser("doctor", help="check this node: kernels, strategies, NCCL, memory, rates")
    d.add_argument(
        "--out", type=out_dir, default=None, help="folder for doctor.json (and a GPU preset)"
    )
    d.set_defaults(func=cmd_doctor)
    g = sub.add_parser(
        "gpu-check",
        help="one GPU, no network: versions, doctor, three real runs and the rank probe, "
        "into one folder (env/gpu-check.sh)",
    )
    g.add_argument(
        "--out", type=out_dir, required=True, help="folder for summary.json, log.txt and records"
    )
    g.set_defaults(func=cmd_gpu_check)
