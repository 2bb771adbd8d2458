"""Argument types and the argument groups several commands share. Bad input exits 2 with one
line naming the field and the rule."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from tspbench.core.config import ConfigError
from tspbench.core.dtypes import DTYPES
from tspbench.core.options import Option, Value
from tspbench.runtime.spec import CHOICES, parse_size

EXIT_USAGE = 2


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` says each option's default, where it has one worth saying (not None or
    False, and not already in its help text)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        silent = default is None or default is False or default is argparse.SUPPRESS
        if "%(default)" in text or silent or default == [] or not text:
            return action.help
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return action.help


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, exit 2
        print(f"tspbench: error: {message}{did_you_mean(message)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def did_you_mean(message: str) -> str:
    """'; did you mean X?' for argparse's invalid choice, where one choice is close."""
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if not choice:
        return ""
    names = [a or b for a, b in re.findall(r"'([^']*)'|([\w.-]+)", choice[2])]
    close = difflib.get_close_matches(choice[1], names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


NEW_TOKENS = (2, 65536)  # --new-tokens of run and plan, and the sweep schema's new_tokens


def progress(command: str, what: str) -> None:
    """One stderr line as a slow phase of ``command`` starts (stdout stays the result)."""
    print(f"tspbench {command}: {what}", file=sys.stderr, flush=True)


def out_file(suffix: str | None = None) -> Callable[[str], str]:
    """An argparse type: an output file, probed when the arguments are read (before any work:
    a folder, a read-only mount or a missing permission is one line, exit 2)."""

    def parse(text: str) -> str:
        from tspbench.runtime.record import probe_file

        try:
            probe_file(text, suffix)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return parse


def out_dir(text: str) -> str:
    """An argparse type: an output folder, probed (made if missing) when the arguments are read."""
    from tspbench.runtime.record import probe_dir

    try:
        probe_dir(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def size_bytes(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1000000' -> bytes."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_in(lo: int, hi: int = 2**24):
    """An integer argument in [lo, hi] (the upper bound catches typos such as 10**12)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text!r}: must be between {lo} and {hi}")
        return v

    return parse


def seconds(text: str) -> float:
    """A number of seconds from 1 to a week (the sweep schema's range: below a second every
    collective would time out)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number") from None
    if not 1 <= v <= 7 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: must be between 1 and 604800 seconds")
    return v


def gib(text: str) -> float:
    """A device size in GiB: finite, above 0 and at most 64 TiB (NaN or -5 would make every
    plan "fit" or none)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of GiB") from None
    if not 0 < v <= 65536:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0 and at most 65536 GiB")
    return v


def add_run_args(p: argparse.ArgumentParser, strategy: str | None = None) -> None:
    """The arguments that define a run (``strategy``: a default, else --strategy is required)."""
    from tspbench.runtime.registry import all_options, strategies, takers

    p.add_argument(
        "--strategy", required=strategy is None, default=strategy, choices=sorted(strategies())
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="preset (tiny, small, 7b, llama3-8b, llama2-13b) or a Hugging Face config.json "
        "(docs/models.md; workflows/models/ has published ones)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a model field, e.g. --set kv_heads=4 (repeatable)",
    )
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--seq-len", type=int_in(1), help="sequence length")
    length.add_argument(
        "--prompt-len", dest="seq_len", type=int_in(1), help="decode, generate: --seq-len"
    )
    p.add_argument(
        "--degree",
        type=int_in(1, 65536),
        default=None,
        help="D, ranks in one model group (tpsp: defaults to tp x sp)",
    )
    p.add_argument("--tp", type=int_in(1, 65536), default=1, help="T (tpsp)")
    p.add_argument("--sp", type=int_in(1, 65536), default=1, help="Sigma (tpsp)")
    p.add_argument("--dp", type=int_in(1, 65536), default=1, help="model replicas")
    p.add_argument(
        "--mode",
        choices=CHOICES["mode"],
        default="train",
        help="infer: one forward pass; decode, generate: prefill then greedy decode steps "
        "(docs/decode.md; decode reports per token, generate the whole generation)",
    )
    p.add_argument(
        "--new-tokens",
        type=int_in(*NEW_TOKENS),
        default=None,
        help="decode, generate: tokens generated per sequence (default 16)",
    )
    p.add_argument("--batch", type=int_in(1, 4096), default=1, help="micro-batch per replica")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument(
        "--recompute",
        choices=("none", "full"),
        default="none",
        help="activation checkpointing per layer (every strategy)",
    )
    for option in all_options().values():  # each strategy's own, named once
        values = ",".join(map(option.text, option.values()))
        p.add_argument(
            option.flag,
            type=option_type(option),
            choices=option.choices or None,  # argparse's "invalid choice" (and did you mean)
            default=None,
            metavar=f"{{{values}}}" if values else "N",
            help=f"{', '.join(takers(option.name))}: {option.help} "
            f"(default: {option.text(option.default)})",
        )


def option_type(option: Option) -> Callable[[str], Value]:
    """An argparse type reading a strategy option's text (ValueError: one line, exit 2)."""

    def parse(text: str) -> Value:
        try:
            return option.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """Pipeline stages: only measured runs take them (the closed forms, the estimator and the
    cost model do not model pipelines yet, so their commands refuse the flags)."""
    p.add_argument(
        "--pp", type=int_in(1, 65536), default=1,
        help="pipeline stages (world = pp x dp x D; tsp and tp run as stages)",
    )  # fmt: skip
    p.add_argument(
        "--pp-schedule", default=None,
        help="with --pp > 1: torch.distributed.pipelining's schedule, gpipe, 1f1b (default), "
        "interleaved1f1b (two stages per rank) or interleavedzb (two stages per rank, each "
        "backward split into an input pass and a later weight pass; not fsdp_cp)",
    )  # fmt: skip
    p.add_argument(
        "--microbatches", type=int_in(1, 4096), default=None,
        help="with --pp > 1: micro-batches the schedule splits --batch into (default: pp)",
    )  # fmt: skip


def add_measure_args(p: argparse.ArgumentParser) -> None:
    """What only a measured run uses (``model``, ``estimate`` and ``project`` time nothing)."""
    p.add_argument("--warmup", type=int_in(0, 1000), default=1)
    p.add_argument("--steps", type=int_in(1, 1000), default=3)
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0)
    p.add_argument(
        "--max-memory",
        type=size_bytes,
        default=None,
        help="per-rank budget for tracked live bytes; exceeding it is an OOM",
    )
    p.add_argument("--quiet", action="store_true")


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="record path (.json), written atomically")
    p.add_argument(
        "--launch",
        choices=("env", "local"),
        default="env",
        help="env: ranks from torchrun/Slurm/MPI; local: spawn --nproc ranks here",
    )
    p.add_argument("--nproc", type=int_in(1, 65536), default=None)
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: a GPU when one is visible; cuda: a GPU or exit 2 (never a silent CPU run)",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=300.0,
        help="seconds a collective may wait before the run is declared hung",
    )
    p.add_argument(
        "--step-timeout",
        type=seconds,
        default=3600.0,
        help="seconds a rank may work outside any collective without progress (a hang)",
    )
    p.add_argument(
        "--time-limit",
        type=seconds,
        default=None,
        help="seconds the whole run may take; then it stops and records why",
    )
    p.add_argument(
        "--cell",
        action="store_true",
        help="a pipeline cell: a final record (ok, oom, error) exits 0; an interrupted run "
        "writes its record to OUT.interrupted.json, never to --out",
    )


def launch_argv(args: argparse.Namespace) -> list[str]:
    """The launch options a spawned rank gets again (the spec and the output apart)."""
    argv = ["--timeout", str(args.timeout), "--step-timeout", str(args.step_timeout)]
    argv += ["--device", args.device]
    argv += ["--time-limit", str(args.time_limit)] if args.time_limit else []
    return argv + (["--cell"] if args.cell else [])
