"""train.py's data flags (`DataArguments`, parsed with TrainingArguments by HfArgumentParser) and the sequence
length a run trains with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from hf_scale.errors import UserError

if TYPE_CHECKING:  # annotation only: the flags are read (train.py --help) before transformers loads
    from transformers import PretrainedConfig

DEFAULT_MAX_SEQ_LENGTH = 2048
"""--max_seq_length when not given, capped at the model's max_position_embeddings."""


@dataclass
class DataArguments:
    dataset_name: list[str] | None = field(
        default=None,
        metadata={"help": "Hub dataset id(s) or local dataset directory(ies), loaded with `datasets.load_dataset`; "
                  "several are mixed (see --mixture_weights)."},
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "Configuration (subset) of --dataset_name, if it has several."}
    )
    train_file: list[str] | None = field(
        default=None,
        metadata={"help": "Training data file(s): .json, .jsonl, .csv, .parquet or .txt (by extension); several "
                  "are mixed (see --mixture_weights), each in its own format."},
    )
    validation_file: str | None = field(
        default=None,
        metadata={"help": "Validation data file (same formats as --train_file), evaluated with --eval_strategy or "
                  "--do_eval."},
    )
    train_split: str = field(default="train", metadata={"help": "Split of --dataset_name used for training."})
    text_column: str | None = field(
        default=None, metadata={"help": "Column of plain text (every token is a target). Auto: 'text'."}
    )
    prompt_column: str | None = field(
        default=None,
        metadata={"help": "Prompt column of prompt/response data. Auto: instruction, prompt or question."},
    )
    response_column: str | None = field(
        default=None,
        metadata={"help": "Response column of prompt/response data. Auto: response, completion or answer."},
    )
    messages_column: str | None = field(
        default=None,
        metadata={"help": "Column of chat messages (list of {role, content}), rendered with the tokenizer's "
                  "chat template. Auto: 'messages'."},
    )
    max_seq_length: int | None = field(
        default=None,
        metadata={"help": "Examples are truncated to this many tokens; at most the model's "
                  f"max_position_embeddings. Default: the smaller of {DEFAULT_MAX_SEQ_LENGTH} and that limit."},
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Pack whole examples into rows of up to --max_seq_length tokens (best-fit decreasing "
                  "within a shuffled window, TRL's convention; then each window's rows are evened out, so ranks get "
                  "balanced token counts); --per_device_train_batch_size then counts packed rows. Position ids "
                  "restart per example: no attention across examples."},
    )
    packing_strategy: str = field(
        default="bfd",
        metadata={"help": "With --packing: bfd (examples longer than --max_seq_length are truncated) or "
                  "bfd_split (they are split into pieces of at most --max_seq_length tokens)."},
    )
    packing_window: int = field(
        default=1000,
        metadata={"help": "With --packing: examples packed together by one best-fit-decreasing pass (TRL packs "
                  "per 1000 too); the dataset is shuffled (seeded) before it is cut into equal windows."},
    )
    completion_only_loss: bool | None = field(
        default=None,
        metadata={"help": "true/false: train only on response / assistant tokens. Unset: true for "
                  "prompt/response and messages data, false for plain text (where true is an error)."},
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes used to tokenize the dataset (datasets.map num_proc)."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training examples (quick runs, tests)."}
    )
    max_bad_row_fraction: float = field(
        default=0.0,
        metadata={"help": "Rows that cannot be used (a missing or null column, a value that is not text, an "
                  "empty text or response, a chat message without role or content) stop the run with the "
                  "count and the first one. Allow dropping up to this fraction of the rows instead (0-1)."},
    )


    def __post_init__(self):
        # One source may be given as a plain string (Python callers, tests): a list of one.
        for name in ("dataset_name", "train_file"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])


def check_max_seq_length(max_seq_length: int | None, model_config: PretrainedConfig) -> int:
    """The sequence length to train with: the default (None) fitted to the model, or the flag's value; a value
    the model cannot attend over (positions past its rotary/embedding range) is refused."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if max_seq_length is None:
        return min(DEFAULT_MAX_SEQ_LENGTH, limit) if limit else DEFAULT_MAX_SEQ_LENGTH
    if max_seq_length <= 0:
        raise UserError(f"--max_seq_length {max_seq_length}: must be a positive number of tokens")
    if limit is not None and max_seq_length > limit:
        raise UserError(
            f"--max_seq_length {max_seq_length} is above the model's max_position_embeddings {limit}; "
            f"use at most {limit}"
        )
    return max_seq_length


@dataclass
class SourceArguments:
    mixture_weights: list[float] | None = field(
        default=None,
        metadata={"help": "With several --train_file/--dataset_name: each one's share of the training examples, "
                  "in the same order (normalised to sum 1), e.g. --train_file a.jsonl b.jsonl --mixture_weights "
                  "0.7 0.3. Unset: the sources are concatenated."},
    )
    mixture_stopping_strategy: Literal["first_exhausted", "all_exhausted", "all_exhausted_without_replacement"] = (
        field(
            default="first_exhausted",
            metadata={"help": "With --mixture_weights (datasets.interleave_datasets): first_exhausted stops when one "
                      "source runs out (no row repeats); all_exhausted goes on until every source is used up (rows "
                      "of small sources repeat); all_exhausted_without_replacement takes every row once."},
        )
    )
    validation_split_percentage: float | None = field(
        default=None,
        metadata={"help": "Carve this percentage of each source's training rows (seeded) into the validation set, "
                  "for sources without a validation split."},
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N validation examples (quick evaluations)."}
    )
