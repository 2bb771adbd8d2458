"""``tspbench run``, ``overlap`` and ``layout``: argument handling only."""

from __future__ import annotations

import argparse

from tspbench.cli.args import (
    add_launch_args,
    add_measure_args,
    add_pipeline_args,
    add_run_args,
    int_in,
    launch_argv,
)
from tspbench.core.config import require_dense
from tspbench.runtime.record import check_out
from tspbench.runtime.spec import RunSpec


def _checked(args: argparse.Namespace) -> RunSpec:
    """The spec, the output path and the host's memory checked before anything starts."""
    import torch

    from tspbench.core import attention
    from tspbench.core.compat import require_torch
    from tspbench.core.config import ConfigError
    from tspbench.core.dtypes import DTYPES
    from tspbench.runtime.launch import check_device, check_host_memory

    require_torch()
    check_device(args.device)
    attention.env_backend()  # a kernel named in the environment: one the suite has
    spec = RunSpec.from_args(args)
    gpu = args.device == "cuda" or args.device == "auto" and torch.cuda.is_available()
    where = "cuda" if gpu else "cpu"
    problem = attention.env_backend_problem(where, DTYPES[spec.dtype])
    if problem:  # ... and one that runs on this device and dtype
        raise ConfigError(problem)
    check_out(args.out, args.cell)
    local = 1
    if args.launch == "local":
        from tspbench.runtime.local import check_local_world

        local = spec.layout.world_size
        check_local_world(local, args.nproc or local)
    check_host_memory(spec, local, _host_peak(args.device, spec))
    return spec


def _host_peak(device: str, spec: RunSpec) -> float:
    """A rank's peak bytes in closed form (docs/method.md section 7) when it computes in this
    host's memory; 0 when a GPU holds it (there a too-large run is recorded as ``oom``)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return 0.0
    if spec.cfg.moe:
        return _experts_bound(spec)
    from tspbench.projection.plan import peak_of
    from tspbench.runtime.pipelined import ZERO_BUBBLE

    if spec.pp_schedule in ZERO_BUBBLE:  # not modelled (docs/projection.md): a guard's margin
        # over interleaved 1F1B's closed form, whose placement it shares (measured: at most
        # 1.3 times it, TP's last stage, whose graph torch keeps from input to weight pass)
        return 2 * peak_of(spec.replace(pp_schedule="interleaved1f1b"))
    return peak_of(spec)


def _experts_bound(spec: RunSpec) -> float:
    """A rank's peak bytes bounded from above for a model with experts, whose closed forms
    assume even routing where a run routes by data (an expert may get every token's rows):
    every parameter with its gradient and AdamW's two moments (fp32), and every layer's
    activations over a replica's tokens as a plain layer whose MLP is the k routed experts and
    the shared one wide, kept for backward, and the fp32 logits twice."""
    cfg, tokens = spec.cfg, spec.batch * spec.seq_len
    width = (
        8 * cfg.hidden
        + 2 * cfg.q_dim
        + 2 * cfg.kv_dim
        + 3 * (cfg.top_k * cfg.moe_ffn + cfg.shared_ffn)
    )
    act = 4 * tokens * (cfg.layers * width + 2 * cfg.vocab)
    return 16.0 * cfg.n_params() + act


def cmd_run(args: argparse.Namespace) -> int:
    spec = _checked(args)
    if args.launch == "local":
        from tspbench.runtime.local import run_local

        return run_local("run", spec, args.out, *_local(args, spec))
    from tspbench.runtime.run import run_env

    return run_env(
        spec,
        args.out,
        args.timeout,
        time_limit_s=args.time_limit,
        step_timeout_s=args.step_timeout,
        cell=args.cell,
        device_choice=args.device,
    )


def _local(args: argparse.Namespace, spec: RunSpec) -> tuple:
    """``run_local``'s launch arguments: ranks, their options, the launcher's own deadline
    (the time limit plus a minute for the ranks to write and end), the cell switch, and how
    long a rank may show no sign of life (``--timeout``)."""
    deadline = args.time_limit + 60 if args.time_limit else None
    nproc = args.nproc or spec.layout.world_size
    return nproc, launch_argv(args), deadline, args.cell, args.timeout


def cmd_overlap(args: argparse.Namespace) -> int:
    from tspbench.runtime.comm_hiding import check_hides

    spec = _checked(args)
    why = "its compute-only step skips the exchanges that size the experts' work"
    require_dense(spec.cfg, "tspbench overlap", why)
    check_hides(spec)
    if args.launch == "local":
        from tspbench.runtime.local import run_local

        return run_local("overlap", spec, args.out, *_local(args, spec))
    from tspbench.runtime.comm_hiding import bench_work
    from tspbench.runtime.run import run_env

    return run_env(spec, args.out, args.timeout, bench_work, step_timeout_s=args.step_timeout)


def cmd_layout(args: argparse.Namespace) -> int:
    import json

    from tspbench.runtime.layout import describe, world_layout

    lay = world_layout(args.strategy, args.world, args.degree, args.tp, args.sp, args.pp)
    if args.json:
        print(json.dumps({**lay.as_dict(), "crossing": lay.crossing(args.gpus_per_node)}))
    else:
        print(describe(lay, args.gpus_per_node))
    return 0


def add_parsers(sub) -> None:
    from tspbench.runtime.registry import strategies

    r = sub.add_parser("run", help="one measured run, written as a JSON record")
    add_run_args(r)
    add_pipeline_args(r)
    add_measure_args(r)
    add_launch_args(r)
    r.set_defaults(func=cmd_run, guarded=True)
    o = sub.add_parser("overlap", help="how much of a strategy's traffic hides behind compute")
    add_run_args(o, strategy="tsp")
    add_measure_args(o)
    add_launch_args(o)
    o.set_defaults(func=cmd_overlap, guarded=True)
    lay = sub.add_parser("layout", help="list model and data-parallel groups, flag node crossings")
    lay.add_argument("--world", type=int_in(1, 65536), required=True)
    lay.add_argument("--gpus-per-node", type=int_in(1, 65536), required=True)
    lay.add_argument("--strategy", required=True, choices=sorted(strategies()))
    lay.add_argument("--degree", type=int_in(1, 65536), default=None)
    lay.add_argument("--tp", type=int_in(1, 65536), default=1)
    lay.add_argument("--sp", type=int_in(1, 65536), default=1)
    lay.add_argument("--pp", type=int_in(1, 65536), default=1, help="pipeline stages")
    lay.add_argument("--json", action="store_true", help="print the groups as JSON")
    lay.set_defaults(func=cmd_layout)
