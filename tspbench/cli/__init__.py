"""The ``tspbench`` command line: one module per command group, argument handling only.
Bad input exits 2 with one line naming the field and the rule."""

from __future__ import annotations

import argparse
import sys

from tspbench.cli.args import EXIT_USAGE, Parser
from tspbench.core.config import ConfigError


class Version(argparse.Action):
    """``tspbench --version``: what produced a number, in one line (torch is imported only
    here, so that the parser itself stays quick)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import platform
        from importlib.metadata import PackageNotFoundError, version

        import torch

        from tspbench.runtime.record import git_commit

        try:
            ours = version("tspbench")
        except PackageNotFoundError:  # run from a checkout without an install
            ours = "(not installed)"
        commit = (git_commit() or "no git checkout")[:12]
        print(f"tspbench {ours} (commit {commit}), torch {torch.__version__}, "
              f"python {platform.python_version()}")  # fmt: skip
        parser.exit(0)


def make_parser() -> Parser:
    from tspbench.cli import doctor, pipeline, plan, run, scale

    p = Parser(prog="tspbench", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    p.add_argument("--version", action=Version, nargs=0, help="package, commit, torch, python")
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
    except OSError as e:  # a path the command was given: unreadable, unwritable, full, gone
        if args.debug:
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"tspbench: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # a bug or an input no check foresaw: one line, never a traceback
        if args.debug:
            raise
        text = str(e).splitlines()[0] if str(e) else ""
        print(
            f"tspbench {args.cmd}: unexpected {type(e).__name__}: {text} "
            "(run again with `tspbench --debug ...` for the traceback)",
            file=sys.stderr,
        )
        return 1
