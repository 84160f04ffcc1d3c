"""`hf-scale` command line. Each sub-command lives in its own module and registers itself here
with ``register(subparsers)``; the parser sets ``func(args) -> int`` as the handler."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from hf_scale import __version__
from hf_scale.errors import EXIT_BAD_INPUT, run_or_exit


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line (`hf-scale generate: error: ...`) and exit 2, like every other bad input;
    the usage is one `--help` away. Sub-parsers inherit the class from the top-level parser."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="hf-scale",
        description="One typed config -> accelerate YAML, DeepSpeed JSON and launch scripts, checked.",
        epilog="Run `hf-scale COMMAND --help` for each command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"hf-scale {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from hf_scale import check, demo, doctor, export, generate, plan, plot

    generate.register(subparsers)
    check.register(subparsers)
    export.register(subparsers)
    demo.register(subparsers)
    plan.register(subparsers)
    plot.register(subparsers)
    doctor.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run_or_exit("hf-scale", lambda: args.func(args))
    except BrokenPipeError:
        # `hf-scale schema | head`: the reader went away. Silence the final flush and exit like a shell
        # pipeline would (128 + SIGPIPE), without a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
