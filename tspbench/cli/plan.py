"""``tspbench plan | plan-map | plan-check``: which strategy, degrees and micro-batch to run a model
with on a cluster (projected), the map of winners over S x GPUs, and the planner's check against
measured and estimated cells."""

from __future__ import annotations

import argparse
import json

from tspbench.cli.args import NEW_TOKENS, gib, int_in, out_dir, out_file, progress
from tspbench.core.dtypes import DTYPES
from tspbench.projection.plan.types import DEFAULT_SCHEDULES
from tspbench.runtime.pipelined import PROJECTED, SCHEDULES

GiB = 2**30


def schema_models() -> list[str]:
    """The model presets a sweep config may name (tspbench/schemas/config.schema.yaml)."""
    from tspbench.runtime.registry import schema

    return list(schema("config.schema.yaml")["properties"]["model"]["enum"])


def cmd_plan(args: argparse.Namespace) -> int:
    from tspbench.projection.plan import Request, cache_dir, pipeline_config, render, search
    from tspbench.runtime.registry import searched

    req = Request.make(
        args.model,
        args.hardware,
        args.seq_len,
        args.gpus,
        memory_cap=None if args.memory_cap is None else args.memory_cap * GiB,
        max_degree=args.max_degree,
        mode=args.mode,
        new_tokens=args.new_tokens,
        dtype=args.dtype,
        global_batch=args.global_batch,
        max_batch=args.max_batch,
        recompute=("none", "full") if args.recompute == "both" else (args.recompute,),
        pp=tuple(args.pp),
        pp_schedules=PROJECTED if "all" in args.pp_schedule else tuple(args.pp_schedule),
        options={
            k: (o.parse(getattr(args, k)),)
            for k, o in searched().items()
            if getattr(args, k, "all") != "all"
        },
    )
    progress(
        "plan",
        f"costing every layout of {args.model} on {args.gpus} x {args.hardware} at S = "
        f"{args.seq_len} (operation counts: traced once per shape, then cached"
        + (", not here)" if args.no_cache else f" in {cache_dir(args.cache)})"),
    )
    plan = search.plan(
        req,
        top=args.top,
        exact=args.exact,
        estimate=args.estimate_top if args.estimate else 0,
        kernel=args.kernel,
        cache=args.cache,
        use_cache=not args.no_cache,
    )
    models = schema_models()
    obj = render.to_json(plan)
    if plan.best is not None:  # (obj["best"] too)
        assert plan.best.cand.spec is not None  # a fitting candidate is a valid one
        obj["pipeline_config"] = pipeline_config(req, plan.best.cand.spec, models)
    if args.out:  # probed when the arguments were read (args.out_file)
        from tspbench.runtime.record import write_json

        write_json(args.out, obj)
    print(json.dumps(obj, indent=1) if args.json else render.render(plan, models))
    return 0


def cmd_plan_map(args: argparse.Namespace) -> int:
    from tspbench.projection.plan import load_config, sweep, write_map

    cfg = load_config(args.config)
    table = sweep(cfg, args.model, args.hardware, cache=args.cache, progress=True)
    write_map(table, cfg, args.model, args.hardware, args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_plan_check(args: argparse.Namespace) -> int:
    from tspbench.projection.plan import check
    from tspbench.runtime.record import write_atomic

    text = check.check(
        args.summary, args.hardware, args.memory, args.memory_hardware, cache=args.cache
    )
    print(text)
    if args.out:
        write_atomic(args.out, text)
    return 0


def add_parsers(sub) -> None:
    from tspbench.runtime.registry import searched, takers

    p = sub.add_parser(
        "plan", help="rank strategies, degrees and micro-batches for a model on G GPUs (projected)"
    )
    p.add_argument(
        "--model", required=True, help="preset (7b, llama3-8b, ...) or a Hugging Face config.json"
    )
    p.add_argument("--hardware", default="mi300x", help="mi300x, h100, h200 or a calibrated .json")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--seq-len", type=int_in(1), help="sequence length")
    length.add_argument(
        "--prompt-len", dest="seq_len", type=int_in(1), help="decode, generate: --seq-len"
    )
    p.add_argument("--gpus", type=int_in(1, 65536), required=True, help="G, GPUs in all")
    p.add_argument(
        "--global-batch",
        type=int_in(1),
        default=None,
        help="sequences per step: micro-batch = global batch / dp (default: micro-batches 1..16)",
    )
    p.add_argument(
        "--mode",
        choices=("train", "infer", "decode", "generate"),
        default="train",
        help="decode: rank by generated tokens/s of the G GPUs, each model group serving its "
        "own batch (docs/decode.md); generate: prefill and decode together",
    )
    p.add_argument(
        "--new-tokens",
        type=int_in(*NEW_TOKENS),  # run's range: a plan's run line must run
        default=None,
        help="decode, generate: tokens generated per sequence (default 16)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument(
        "--memory-cap", type=gib, default=None, help="GiB per GPU (default: the hardware's memory)"
    )
    p.add_argument(
        "--max-degree",
        type=int_in(1, 65536),
        default=None,
        help="largest model group D (default: the hardware's GPUs per node)",
    )
    p.add_argument("--max-batch", type=int_in(1, 4096), default=16, help="largest micro-batch")
    p.add_argument("--recompute", choices=("none", "full", "both"), default="both")
    p.add_argument(
        "--pp",
        type=int_in(1, 65536),
        nargs="+",
        default=(),
        help="pipeline stages to try (default: 1 and every pp dividing the layers and G/D, for "
        "the strategies that run as stages; --pp 1: no pipelines)",
    )
    p.add_argument(
        "--pp-schedule",
        nargs="+",
        choices=(*SCHEDULES, "all"),
        default=list(DEFAULT_SCHEDULES),
        help="the pipelines' schedules to try (default 1f1b; gpipe's projected step is 1F1B's, "
        "with more micro-batches in flight, so it never wins; interleaved1f1b, two stages per "
        "rank: half the bubble's time for twice the sends and more in flight (docs/projection.md); "
        "all: every one projected; interleavedzb runs but is not projected)",
    )
    for name, option in searched().items():  # the strategies' options with listed values
        if option.values():
            takes = ", ".join(takers(name))
            p.add_argument(
                option.flag,
                choices=(*map(option.text, option.values()), "all"),
                default="all",
                help=f"{takes}: {option.help}; every value is tried unless one is named",
            )
    p.add_argument("--top", type=int_in(1, 1000), default=10, help="rows of the ranked table")
    p.add_argument("--json", action="store_true", help='print {"candidates": [...], ...}')
    p.add_argument("--out", type=out_file(".json"), default=None, help="also write the JSON here")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="re-check the best rows with the fake-tensor estimator (slow; cached)",
    )
    p.add_argument("--estimate-top", type=int_in(1, 100), default=3, help="rows to re-check")
    p.add_argument("--kernel", choices=("fused", "cpu_flash"), default="fused")
    p.add_argument(
        "--exact", action="store_true", help="count every configuration's operations (slow)"
    )
    p.add_argument("--cache", default=None, help="cache folder (default: ~/.cache/tspbench)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.set_defaults(func=cmd_plan)

    m = sub.add_parser("plan-map", help="winners, feasibility and TSP's margin over S x GPUs")
    m.add_argument("--config", default="workflows/config/plan.yaml")
    m.add_argument("--model", required=True)
    m.add_argument("--hardware", required=True)
    m.add_argument("--out", type=out_dir, required=True, help="folder for map.csv and the figures")
    m.add_argument("--cache", default=None)
    m.set_defaults(func=cmd_plan_map)

    c = sub.add_parser("plan-check", help="the planner against measured and estimated cells")
    c.add_argument("--summary", nargs="+", required=True, help="repeated runs of one sweep")
    c.add_argument("--hardware", required=True, help="the calibrated preset of that machine")
    c.add_argument("--memory", required=True, help="projected memory.csv (fake-tensor estimates)")
    c.add_argument("--memory-hardware", default="mi300x", help="the cap memory.csv's fits use")
    c.add_argument("--out", type=out_file(), default=None, help="Markdown")
    c.add_argument("--cache", default=None)
    c.set_defaults(func=cmd_plan_check)
