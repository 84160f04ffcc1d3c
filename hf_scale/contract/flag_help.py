"""train.py's `--help`: hf_scale's own flags first, by topic, then the TrainingArguments flags most runs set;
`--help-all` shows every flag (the whole of TrainingArguments, ~150 more).

The parser is transformers' HfArgumentParser over train.py's dataclasses; this only changes how its help is
laid out, never what it parses. A flag's section follows the dataclass that defines it.
"""

from __future__ import annotations

import argparse
import dataclasses

USAGE = "%(prog)s [RECIPE.yaml] [--FLAG VALUE ...]"
SECTIONS = {
    # dataclass name: section title
    "ModelArguments": "model",
    "DataArguments": "data",
    "SourceArguments": "data",
    "ScaleArguments": "hf_scale",
}
OWN = "hf_scale"
"""Section of the flags no dataclass defines (--config, --help, --help-all)."""
TRAINING = "training (transformers' TrainingArguments)"
COMMON_TRAINING_FLAGS = (
    "output_dir",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "optim",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "deepspeed",
    "seed",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "eval_strategy",
    "eval_steps",
    "per_device_eval_batch_size",
    "do_eval",
    "report_to",
    "push_to_hub",
    "hub_model_id",
    "torch_compile",
)
"""The TrainingArguments flags `--help` shows (the rest: `--help-all`), in this order."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """One spelling per flag (`--learning_rate`; HfArgumentParser also accepts `--learning-rate`), and no
    "(default: None)"."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [s for s in action.option_strings if "-" not in s.lstrip("-")] or action.option_strings
        invocation = ", ".join(shown)
        if action.nargs != 0:
            invocation += " " + self._format_args(action, self._get_default_metavar_for_optional(action))
        return invocation

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


class _HelpAll(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(parser.format_help(full=True), end="")
        parser.exit()


class GroupedHelp:
    """Mixin for an HfArgumentParser: grouped `--help`, and `--help-all`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("prog", "train.py")  # also under `python -m hf_scale.train` and the launchers
        kwargs.setdefault("usage", USAGE)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self.add_argument("--help-all", action=_HelpAll,
                          help="show every flag, all of TrainingArguments included, and exit")

    def format_help(self, full: bool = False) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        hidden = 0
        for title, actions in self.help_sections().items():
            if title == TRAINING and not full:
                shown = _common_training_actions(actions)
                hidden = len({a.dest for a in actions} - {a.dest for a in shown})
                actions, title = shown, f"{title}, the most used"
            formatter.start_section(title)
            formatter.add_arguments(actions)
            formatter.end_section()
        if hidden:
            formatter.add_text(f"{hidden} more TrainingArguments flags (evaluation, logging, checkpoints, the Hub, "
                               "optimizers, data loading, ...): %(prog)s --help-all")
        formatter.add_text(self.epilog)
        return formatter.format_help()

    def section_of_dest(self) -> dict[str, str]:
        """Each flag's section, by the dataclass that defines it (a flag no dataclass defines: OWN)."""
        section_of_dest: dict[str, str] = {}
        for dtype in self.dataclass_types:
            title = SECTIONS.get(dtype.__name__, TRAINING if dtype.__module__.startswith("transformers") else OWN)
            for field in dataclasses.fields(dtype):
                section_of_dest.setdefault(field.name, title)
        return section_of_dest

    def help_sections(self) -> dict[str, list[argparse.Action]]:
        """Every action by section: model, data, hf_scale, then TrainingArguments (in the parser's order)."""
        section_of_dest = self.section_of_dest()
        sections: dict[str, list[argparse.Action]] = {title: [] for title in (*dict.fromkeys(SECTIONS.values()),
                                                                               TRAINING)}
        for action in self._actions:
            if action.help != argparse.SUPPRESS:
                sections.setdefault(section_of_dest.get(action.dest, OWN), []).append(action)
        return {title: actions for title, actions in sections.items() if actions}


def _common_training_actions(actions: list[argparse.Action]) -> list[argparse.Action]:
    """COMMON_TRAINING_FLAGS' actions in that order; of a bool flag only `--flag` (not its `--no_flag`)."""
    by_dest = {a.dest: a for a in actions if f"--{a.dest}" in a.option_strings}
    return [by_dest[dest] for dest in COMMON_TRAINING_FLAGS if dest in by_dest]
