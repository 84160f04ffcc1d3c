"""train.py's parser: every flag it takes (hf_scale's own, the data flags, every TrainingArguments flag, --config
for a recipe), bad flags reported in one line, --help led by hf_scale's own flags."""

from __future__ import annotations

import argparse
import json
import os

from transformers import HfArgumentParser, TrainingArguments

from hf_scale.contract.data_arguments import DataArguments, SourceArguments
from hf_scale.contract.flag_help import GroupedHelp
from hf_scale.contract.model_arguments import ModelArguments
from hf_scale.contract.recipe import add_config_flag, expand_recipe, recipe_argument
from hf_scale.contract.scale_arguments import ScaleArguments
from hf_scale.errors import UserError
from hf_scale.exit_codes import RESUME_DEFAULT_ENV
from hf_scale.files.reading import NEGATIVE_NUMBER
from hf_scale.knowledge import rules

DEFAULT_OUTPUT_DIR = "outputs/hf_scale-run"


class _OneLineParser(GroupedHelp, HfArgumentParser):
    """argparse prints usage and exits; hf_scale reports bad flags as one line (exit 2) instead. --help leads
    with hf_scale's own flags (hf_scale.contract.flag_help)."""

    def error(self, message):
        raise UserError(message)


def build_parser() -> HfArgumentParser:
    parser = _OneLineParser(
        (ModelArguments, DataArguments, SourceArguments, ScaleArguments, TrainingArguments),
        allow_abbrev=False,  # a typo like --learning_rat must not silently mean --learning_rate
        description="Fine-tune a causal LM with the HF Trainer or hf_scale's Accelerator loop. Every "
        "TrainingArguments flag works with the Trainer (--loop accelerate refuses those it does not apply). "
        "With no model/data flags it fine-tunes the tiny Llama shipped with "
        "hf_scale on its sample dataset (CPU, seconds). Launch unchanged with python, torchrun, "
        "accelerate launch or deepspeed. All flags can come from a recipe file: python train.py recipe.yaml "
        "[flags that override it].",
    )
    parser._negative_number_matcher = NEGATIVE_NUMBER  # -1e-8 is a value, not a flag
    add_config_flag(parser)
    parser.set_defaults(output_dir=DEFAULT_OUTPUT_DIR, report_to="none", logging_steps=1,
                        dataloader_num_workers=None)
    parser._option_string_actions["--dataloader_num_workers"].help = (
        "Processes that collate micro-batches ahead of the step. Default: 2 per GPU process when the cores "
        "allow, 0 without a GPU."
    )
    # HfArgumentParser types these dict flags as `dict` or `str`: neither parses (or checks) a JSON object.
    for name in ("--liger_kernel_config", "--lr_scheduler_kwargs", "--activation_checkpointing_kwargs"):
        parser._option_string_actions[name].type = _json_object
    return parser


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def parse_flags(argv: list[str], *, read_recipe: bool = True) -> tuple[argparse.Namespace, frozenset[str], str | None]:
    """``argv`` as train.py reads it: the flags, which of them were given and the recipe's path. A recipe's values
    become flags before the command line's (which override them), so "given" covers both (and its ``env:`` is set).
    ``read_recipe=False``: a recipe the arguments name is left unread (`hf-scale check` of a job's flags: the file
    lives where the job runs). An unknown flag is train.py's one-line error."""
    parser = build_parser()
    argv, recipe_path = (expand_recipe if read_recipe else recipe_argument)(parser, list(argv))
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join(unknown)} (see python train.py --help)")
    return namespace, rules.given_flags(argv, vars(namespace)), recipe_path


def resume_default(namespace: argparse.Namespace, given: frozenset[str]) -> None:
    """``--resume_from_checkpoint auto`` when the generated cluster scripts ask for it (RESUME_DEFAULT_ENV=auto) and
    the flags (``given``: any spelling, a recipe) name no checkpoint: an explicit resume always wins."""
    value = os.environ.get(RESUME_DEFAULT_ENV)
    if not value:
        return
    if value != "auto":
        raise UserError(f"{RESUME_DEFAULT_ENV}={value[:100]} is invalid: allowed auto (what the generated cluster "
                        "scripts set), or unset")
    if "resume_from_checkpoint" not in given:
        namespace.resume_from_checkpoint = "auto"
