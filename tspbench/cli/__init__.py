"""The ``tspbench`` command line: one module per command group, argument handling only.
Bad input exits 2 with one line naming the field and the rule."""

from __future__ import annotations

import sys

from tspbench.cli.args import EXIT_USAGE, Parser
from tspbench.core.config import ConfigError


def make_parser() -> Parser:
    from tspbench.cli import doctor, pipeline, plan, run, scale

    p = Parser(prog="tspbench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    run.add_parsers(sub)
    pipeline.add_parsers(sub)
    scale.add_parsers(sub)
    doctor.add_parsers(sub)
    plan.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from tspbench.runtime.guard import release_signals

    args = make_parser().parse_args(argv)
    if not getattr(args, "guarded", False):  # no guard or launcher will take the signals
        release_signals()
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"tspbench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
