"""`hf-scale` command line.

Each sub-command lives in its own module, which adds its parser with ``register(subparsers)`` and sets
``func(args) -> int`` as the handler. Only the module of the command being run is imported (COMMANDS names
each command's module and its one-line summary), so `hf-scale --help` and `hf-scale COMMAND --help` never
load torch, transformers, DeepSpeed or pydantic: the modules import those inside their handlers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from hf_scale import __version__, quiet
from hf_scale.errors import EXIT_BAD_INPUT, run_or_exit
from hf_scale.files.reading import NEGATIVE_NUMBER

COMMANDS = {
    # command: (module whose register() adds it, one-line summary for `hf-scale --help`)
    "generate": ("hf_scale.commands.generate",
                 "write accelerate YAML, DeepSpeed JSON and launch scripts from a config or preset"),
    "presets": ("hf_scale.commands.generate", "list the built-in presets"),
    "schema": ("hf_scale.commands.generate", "print the JSON Schema of the config"),
    "check": ("hf_scale.commands.check",
              "report inconsistencies between an accelerate YAML, a DeepSpeed JSON and training args"),
    "export": ("hf_scale.commands.export",
               "turn a training checkpoint (ZeRO-1/2/3, FSDP2, DDP) into a Hugging Face model directory"),
    "demo": ("hf_scale.commands.demo",
             "generate a ZeRO-3 config and fine-tune the embedded tiny Llama with 2 processes (CPU is fine)"),
    "plan": ("hf_scale.commands.plan",
             "estimate per-GPU memory of every strategy and recommend the fastest that fits"),
    "plot": ("hf_scale.commands.plot", "plot loss curves (metrics.jsonl) and tokens/s per run or strategy"),
    "doctor": ("hf_scale.commands.doctor",
               "check this node before queueing a job (GPUs, versions, kernels, DeepSpeed ops, network, disk)"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line (`hf-scale generate: error: ...`) and exit 2, like every other bad input;
    the usage is one `--help` away. Sub-parsers inherit the class from the top-level parser."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # `--safety-margin -1e-2` is a value, not a flag

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


VERBOSE_HELP = f"show the libraries' own notices (DeepSpeed, transformers, accelerate); also {quiet.VERBOSE_ENV}=1"


def _command_in(argv: list[str]) -> str | None:
    """The sub-command named on the command line (the first argument that is not an option)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with the full sub-parser of the command named in ``argv`` and a one-line entry (its summary in
    COMMANDS) for the others."""
    parser = OneLineErrorParser(
        prog="hf-scale",
        description="One typed config -> accelerate YAML, DeepSpeed JSON and launch scripts, checked.",
        epilog="Run `hf-scale COMMAND --help` for each command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"hf-scale {__version__}")
    parser.add_argument(quiet.VERBOSE_FLAG, action="store_true", help=VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    command = _command_in(argv)
    wanted = {COMMANDS[command][0]} if command in COMMANDS else set()
    for name, (module, summary) in COMMANDS.items():
        if module not in wanted:
            subparsers.add_parser(name, help=summary, add_help=False)
        elif name not in subparsers.choices:  # the module's first command: it adds all of its commands
            importlib.import_module(module).register(subparsers)
    for name, subparser in subparsers.choices.items():
        if COMMANDS[name][0] in wanted:
            # Also after the command (`hf-scale check --verbose`); SUPPRESS keeps a flag given before it.
            subparser.add_argument(quiet.VERBOSE_FLAG, action="store_true", default=argparse.SUPPRESS,
                                   help=VERBOSE_HELP)
    return parser


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """The words before the first `--`, and those after it (None without one): a command that takes arguments for
    another program (`check`'s training args) sets the default ``passthrough`` and receives them there."""
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def main(argv: list[str] | None = None) -> int:
    argv, passthrough = _split_passthrough(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if passthrough is not None:
        if not hasattr(args, "passthrough"):
            parser.error(f"unrecognized arguments: -- {' '.join(passthrough)}")
        args.passthrough = passthrough
    if not (args.verbose or quiet.verbose_requested()):
        quiet.quiet_command()
    try:
        return run_or_exit("hf-scale", lambda: args.func(args))
    except BrokenPipeError:
        # `hf-scale schema | head`: the reader went away. Silence the final flush and exit like a shell
        # pipeline would (128 + SIGPIPE), without a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
