"""Data pipeline of train.py: load, detect the format, tokenize with label masking, collate, shard.

Three dataset formats are understood (column names are auto-detected or given explicitly):

- ``text``: one column of plain text; every token is a target.
- ``prompt_response``: a prompt column and a response column (instruction/response,
  prompt/completion or question/answer); the tokens are ``bos + prompt + response + eos``.
- ``messages``: a list of ``{"role", "content"}`` dicts rendered by the tokenizer's chat template.

With completion-only loss (the default for the last two formats) only response/assistant tokens
are targets; the rest carry label ``-100``. Batches are either padded to the longest example or,
with ``--packing``, rows packed to a token budget (hf_scale.train.data.packing).
"""

from __future__ import annotations

import csv
import logging
import math
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import datasets
import jinja2
import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler
from transformers import DataCollatorForSeq2Seq, PretrainedConfig

from hf_scale.errors import UserError
from hf_scale.inputs import not_a_regular_file
from hf_scale.train.data.embedded import EMBEDDED_DATA_FILE
from hf_scale.train.data.labels import IGNORE_INDEX

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LENGTH = 2048
"""--max_seq_length when not given, capped at the model's max_position_embeddings."""

DatasetFormat = Literal["text", "prompt_response", "messages"]

# File extension -> `datasets` packaged builder.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}

# Auto-detected column names, in order of preference; any prompt name pairs with any response name.
PROMPT_COLUMNS = ("instruction", "prompt", "question")
RESPONSE_COLUMNS = ("response", "completion", "answer")
MESSAGES_COLUMN = "messages"
TEXT_COLUMN = "text"

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


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


def _one_source(flag: str, values: list[str] | None) -> str | None:
    if values is not None and len(values) > 1:
        raise ValueError(f"--{flag}: {len(values)} sources; hf_scale.train.data.sources loads them one by one")
    return values[0] if values else None


@dataclass(frozen=True)
class ResolvedFormat:
    """A dataset format together with the columns it reads."""

    kind: DatasetFormat
    columns: tuple[str, ...]


def _column_list(column_names: list[str]) -> str:
    return ", ".join(column_names) if column_names else "(none)"


def _csv_text_features(path: Path) -> datasets.Features:
    """CSV has no types: every column is read as text (pandas would turn an answer "19" into the integer 19)."""
    with open(path, newline="", encoding="utf-8") as handle:
        header = next(csv.reader(handle), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _load_file(flag: str, path_str: str) -> datasets.Dataset:
    path = Path(path_str)
    problem = not_a_regular_file(path)
    if problem is not None:
        also = " (or the directory as --dataset_name)" if path.is_dir() else ""
        raise UserError(f"--{flag} {path_str}: {problem}; expected a data file ({', '.join(FILE_BUILDERS)}){also}")
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(
            f"--{flag} {path_str}: unsupported extension '{path.suffix}'; allowed: {', '.join(FILE_BUILDERS)}"
        )
    empty = UserError(f"--{flag} {path_str}: the dataset is empty; it needs at least one example")
    # An empty file makes some builders stop without a useful error, so catch it first.
    if path.stat().st_size == 0:
        raise empty
    try:
        kwargs = {"features": _csv_text_features(path)} if builder == "csv" else {}
        loaded = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except OSError as error:
        raise UserError(f"--{flag} {path_str}: cannot be read ({error.strerror or error})") from None
    except (datasets.exceptions.DatasetsError, ValueError) as error:
        if "corresponds to no data" in str(error):  # datasets' words for a file with no rows ("[]", a header)
            raise empty from error
        # datasets wraps the parser's error (JSON/CSV syntax, ...); the cause is what the user can fix.
        cause = error.__cause__ or error
        raise UserError(f"--{flag} {path_str}: could not be read as {builder}: {cause}") from error
    if builder == "text":  # one example per line; blank lines separate, they are not examples
        loaded = loaded.filter(lambda batch: [bool(t.strip()) for t in batch["text"]], batched=True)
    return loaded


def _load_named(args: DataArguments, name: str) -> datasets.DatasetDict:
    try:
        loaded = datasets.load_dataset(name, args.dataset_config_name)
    except (datasets.exceptions.DatasetsError, FileNotFoundError, ConnectionError, ValueError) as error:
        raise UserError(f"--dataset_name {name}: could not be loaded: {error}") from error
    if args.train_split not in loaded:
        raise UserError(
            f"--train_split {args.train_split}: no such split in {name}; "
            f"available: {_column_list(list(loaded))}"
        )
    splits = {"train": loaded[args.train_split]}
    if "validation" in loaded and args.train_split != "validation":
        splits["validation"] = loaded["validation"]
    return datasets.DatasetDict(splits)


def load_raw_datasets(args: DataArguments) -> datasets.DatasetDict:
    """Load ``train`` (and ``validation`` when available) of ONE source: the Hub/a directory, a file, or the
    sample (several sources: hf_scale.train.data.sources loads each through here).

    With no data argument at all, the sample dataset shipped with hf_scale is used.
    """
    dataset_name = _one_source("dataset_name", args.dataset_name)
    train_file = _one_source("train_file", args.train_file)
    if dataset_name and (train_file or args.validation_file):
        raise UserError("--dataset_name and --train_file/--validation_file are mutually exclusive; pass one")
    if args.max_train_samples is not None and args.max_train_samples <= 0:
        raise UserError(
            f"--max_train_samples {args.max_train_samples}: must be a positive number of examples"
        )
    if dataset_name:
        raw = _load_named(args, dataset_name)
    else:
        if args.validation_file and not train_file:
            raise UserError("--validation_file needs --train_file")
        raw = datasets.DatasetDict(
            {"train": _load_file("train_file", train_file or str(EMBEDDED_DATA_FILE))}
        )
        if args.validation_file:
            raw["validation"] = _load_file("validation_file", args.validation_file)
    for split, dataset in raw.items():
        if len(dataset) == 0:
            raise UserError(f"the {split} dataset is empty; it needs at least one example")
    if args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(args.max_train_samples, len(raw["train"]))))
    return raw


def _require_column(flag: str, name: str, column_names: list[str]) -> None:
    if name not in column_names:
        raise UserError(f"--{flag} {name}: no such column; available: {_column_list(column_names)}")


def _first_present(candidates: tuple[str, ...], column_names: list[str]) -> str | None:
    return next((name for name in candidates if name in column_names), None)


def resolve_format(column_names: list[str], args: DataArguments) -> ResolvedFormat:
    """Decide the format and its columns: explicit column flags win, else common names are detected."""
    explicit = {
        "text_column": args.text_column,
        "prompt_column": args.prompt_column,
        "response_column": args.response_column,
        "messages_column": args.messages_column,
    }
    for flag, name in explicit.items():
        if name is not None:
            _require_column(flag, name, column_names)
    chosen = {
        kind
        for kind, flags in (
            ("text", ("text_column",)),
            ("prompt_response", ("prompt_column", "response_column")),
            ("messages", ("messages_column",)),
        )
        if any(explicit[flag] is not None for flag in flags)
    }
    if len(chosen) > 1:
        given = ", ".join(f"--{flag} {name}" for flag, name in explicit.items() if name is not None)
        raise UserError(f"{given}: these select different dataset formats; pass the columns of one format")

    if chosen == {"text"}:
        return ResolvedFormat("text", (args.text_column,))
    if chosen == {"messages"}:
        return ResolvedFormat("messages", (args.messages_column,))
    if chosen == {"prompt_response"}:
        prompt = args.prompt_column or _first_present(PROMPT_COLUMNS, column_names)
        response = args.response_column or _first_present(RESPONSE_COLUMNS, column_names)
        missing = "prompt_column" if prompt is None else "response_column" if response is None else None
        if missing:
            raise UserError(f"--{missing} is needed too; available columns: {_column_list(column_names)}")
        return ResolvedFormat("prompt_response", (prompt, response))

    if MESSAGES_COLUMN in column_names:
        return ResolvedFormat("messages", (MESSAGES_COLUMN,))
    prompt = _first_present(PROMPT_COLUMNS, column_names)
    response = _first_present(RESPONSE_COLUMNS, column_names)
    if prompt and response:
        return ResolvedFormat("prompt_response", (prompt, response))
    if TEXT_COLUMN in column_names:
        return ResolvedFormat("text", (TEXT_COLUMN,))
    raise UserError(
        f"cannot tell the dataset format from its columns ({_column_list(column_names)}); pass --text_column, "
        "--prompt_column/--response_column or --messages_column"
    )


def detect_format(column_names: list[str], args: DataArguments) -> DatasetFormat:
    """The dataset format implied by ``column_names`` and the column flags (see :func:`resolve_format`)."""
    return resolve_format(column_names, args).kind


def resolve_completion_only(kind: DatasetFormat, args: DataArguments) -> bool:
    """``--completion_only_loss`` with its default filled in: on for prompt/response and chat data."""
    if args.completion_only_loss is None:
        return kind != "text"
    if args.completion_only_loss and kind == "text":
        raise UserError(
            "--completion_only_loss true: the dataset is plain text, which has no prompt to mask; "
            "use a prompt/response or messages dataset, or --completion_only_loss false"
        )
    return args.completion_only_loss


def _check_tokenizer(tokenizer: Any, kind: DatasetFormat, completion_only: bool) -> None:
    if kind != "messages":
        if tokenizer.eos_token_id is None:
            raise UserError(
                "the tokenizer has no eos_token; it is appended to every example so the model learns to stop"
            )
        return
    template = tokenizer.chat_template
    if not template:
        raise UserError(
            "the dataset has chat messages but the tokenizer has no chat_template to render them; pass "
            "--chat_template_path FILE (a Jinja chat template)"
        )
    if completion_only and not _GENERATION_TAG.search(str(template)):
        raise UserError(
            "--completion_only_loss true: the tokenizer's chat template has no {% generation %} block, so "
            "assistant tokens cannot be told apart; use a template that marks them (--chat_template_path FILE), or "
            "--completion_only_loss false"
        )


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def _text_problem(column: str, value, *, may_be_empty: bool = False) -> str | None:
    if value is None:
        return f"'{column}' is missing"
    if not isinstance(value, str):
        return f"'{column}' is {_kind(value)}, not text"
    if not may_be_empty and not value.strip():
        return f"'{column}' is empty"
    return None


def _messages_problem(column: str, messages) -> str | None:
    if messages is None:
        return f"'{column}' is missing"
    if not isinstance(messages, list) or not messages:
        return f"'{column}' is {'empty' if isinstance(messages, list) else _kind(messages)}, not a list of messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {i} of '{column}' is {_kind(message)}, not a {{role, content}} object"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"message {i} of '{column}' has {_kind(message.get(key))} {key}, not text"
    return None


def _row_problem(fmt: ResolvedFormat, values: tuple) -> str | None:
    """Why a row cannot be used in format `fmt` (its columns' values, in order), or None."""
    if fmt.kind == "messages":
        return _messages_problem(fmt.columns[0], values[0])
    if fmt.kind == "prompt_response":  # an empty prompt is a prompt; an empty response teaches nothing
        return (_text_problem(fmt.columns[0], values[0], may_be_empty=True)
                or _text_problem(fmt.columns[1], values[1]))
    return _text_problem(fmt.columns[0], values[0])


def _row_problems(batch: dict[str, list], *, fmt: ResolvedFormat) -> dict[str, list[str]]:
    rows = zip(*(batch[column] for column in fmt.columns), strict=True)
    return {"problem": [_row_problem(fmt, values) or "" for values in rows]}


def _first_invalid_utf8(dataset: datasets.Dataset, fmt: ResolvedFormat) -> str:
    """Where the bytes that are not UTF-8 are (only called once decoding failed, so cost is no concern)."""
    import pyarrow as pa

    table = dataset.with_format("arrow")[:]
    for column in fmt.columns:
        values = table[column]
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            continue
        for row, raw in enumerate(values.cast(pa.large_binary()).to_pylist()):
            try:
                raw is None or raw.decode("utf-8")
            except UnicodeDecodeError:
                return f"row {row} of '{column}' is not valid UTF-8 text"
    return f"a value of {', '.join(repr(c) for c in fmt.columns)} is not valid UTF-8 text"


def drop_bad_rows(dataset: datasets.Dataset, fmt: ResolvedFormat, args: DataArguments,
                  split: str = "training") -> datasets.Dataset:
    """Rows that cannot be used are counted, never replaced by empty text: above --max_bad_row_fraction the
    run stops with the count and the first bad row, below it they are dropped with a warning saying so.

    The check runs through ``datasets.map`` (cached like the tokenization); counting is vectorised.
    """
    import pyarrow.compute as pc

    try:
        checked = dataset.map(partial(_row_problems, fmt=fmt), batched=True, remove_columns=dataset.column_names,
                              num_proc=args.preprocessing_num_workers, desc="Checking rows")
    except UnicodeDecodeError:  # the JSON/parquet reader stored bytes that are not UTF-8 as text
        raise UserError(f"the {split} data: {_first_invalid_utf8(dataset, fmt)}; save it as UTF-8") from None
    problems = checked.with_format("arrow")[:]["problem"]
    bad = pc.not_equal(problems, "")
    count = pc.sum(bad).as_py() or 0
    if not count:
        return dataset
    first = pc.indices_nonzero(bad)[0].as_py()
    found = (f"{count} of {len(dataset)} rows of the {split} data cannot be used (first bad row: index {first}, "
             f"{problems[first].as_py()})")
    if count == len(dataset):
        raise UserError(f"{found}; fix the data")
    if count > args.max_bad_row_fraction * len(dataset):
        needed = math.ceil(count / len(dataset) * 1000) / 1000
        raise UserError(f"{found}; fix the data, or drop such rows with --max_bad_row_fraction {needed:g}")
    logger.warning("dropped %s (--max_bad_row_fraction %g)", found, args.max_bad_row_fraction)
    return dataset.select(np.asarray(pc.indices_nonzero(pc.invert(bad)), dtype=np.int64))


def _encode_text(tokenizer: Any, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    encoded = tokenizer(texts)["input_ids"]
    return [(ids + [tokenizer.eos_token_id], ids + [tokenizer.eos_token_id]) for ids in encoded]


def _encode_prompt_response(
    tokenizer: Any, prompts: list[str], responses: list[str], completion_only: bool
) -> list[tuple[list[int], list[int]]]:
    # Prompt and response are tokenized separately so the boundary between them is exact.
    prompt_ids = tokenizer(prompts)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    examples = []
    for prompt, response in zip(prompt_ids, response_ids, strict=True):
        target = response + [tokenizer.eos_token_id]
        prompt_labels = [IGNORE_INDEX] * len(prompt) if completion_only else prompt
        examples.append((prompt + target, prompt_labels + target))
    return examples


def _encode_messages(
    tokenizer: Any, conversations: list[list[dict]], completion_only: bool
) -> list[tuple[list[int], list[int]]]:
    examples = []
    for messages in conversations:
        try:
            encoded = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=completion_only
            )
        except jinja2.TemplateError as error:  # e.g. a role the template does not know, turns out of order
            raise UserError(f"the tokenizer's chat template rejects a conversation ({error}): "
                            f"{str(messages)[:200]}") from None
        ids = list(encoded["input_ids"])
        if completion_only:
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, encoded["assistant_masks"], strict=True)]
        else:
            labels = list(ids)
        examples.append((ids, labels))
    return examples


def _tokenize_batch(
    batch: dict[str, list],
    *,
    tokenizer: Any,
    fmt: ResolvedFormat,
    max_seq_length: int | None,
    completion_only: bool,
) -> dict[str, list[list[int]]]:
    if fmt.kind == "text":
        examples = _encode_text(tokenizer, batch[fmt.columns[0]])
    elif fmt.kind == "prompt_response":
        examples = _encode_prompt_response(
            tokenizer, batch[fmt.columns[0]], batch[fmt.columns[1]], completion_only
        )
    else:
        examples = _encode_messages(tokenizer, batch[fmt.columns[0]], completion_only)
    out: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for ids, labels in examples:
        ids, labels = ids[:max_seq_length], labels[:max_seq_length]
        # Label 0 is never predicted (the loss shifts labels left by one), so it does not count.
        if any(label != IGNORE_INDEX for label in labels[1:]):
            out["input_ids"].append(ids)
            out["labels"].append(labels)
    return out


def tokenize_dataset(dataset: datasets.Dataset, tokenizer: Any, args: DataArguments,
                     split: str = "training") -> datasets.Dataset:
    """Tokenize into ``input_ids`` and ``labels`` (``-100`` on non-targets), truncated to max_seq_length.

    Examples left with no target token (e.g. a prompt longer than max_seq_length) are dropped and
    counted in one warning. Runs through ``datasets.map``, so the result is cached next to the data
    files and reused by a later run with the same tokenizer and arguments; call it inside
    ``accelerator.main_process_first()`` so that only one rank tokenizes. `split` ("training",
    "validation") names the data in the messages about its rows.
    """
    fmt = resolve_format(dataset.column_names, args)
    completion_only = resolve_completion_only(fmt.kind, args)
    _check_tokenizer(tokenizer, fmt.kind, completion_only)
    dataset = drop_bad_rows(dataset, fmt, args, split)
    # Only what changes the output goes into the function, so that the cache fingerprint (a hash of
    # the function and its arguments) does not move when an unrelated flag such as --packing does.
    tokenize = partial(
        _tokenize_batch,
        tokenizer=tokenizer,
        fmt=fmt,
        # bfd_split packing cuts long examples into budget-sized pieces itself (hf_scale.train.data.packing).
        max_seq_length=None if args.packing and args.packing_strategy == "bfd_split" else args.max_seq_length,
        completion_only=completion_only,
    )
    tokenized = dataset.map(
        tokenize,
        batched=True,
        remove_columns=dataset.column_names,
        num_proc=args.preprocessing_num_workers,
        desc="Tokenizing",
    )
    dropped = len(dataset) - len(tokenized)
    if len(tokenized) == 0:
        raise UserError(
            f"--max_seq_length {args.max_seq_length}: no example has a target token left after truncation"
        )
    if dropped:
        logger.warning(
            "dropped %d of %d examples with no target token left after truncation to max_seq_length=%d",
            dropped, len(dataset), args.max_seq_length,
        )
    return tokenized


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


def make_collator(tokenizer: Any, packing: bool, *, pad_to: int | None = None, varlen_kwargs: bool = False):
    """Collate a list of dataset rows into a dict of tensors for ``model(**batch)``.

    - ``packing=True``: rows packed by hf_scale.train.data.packing, collated by its ``PackedCollator``
      (position ids restarting per example, the first label of every example ignored, rows padded to
      `pad_to` or to the longest row; `varlen_kwargs` adds the ``cu_seq_lens`` of varlen kernels).
      The model must run with ``use_cache=False`` (the Trainer's default; set
      ``model.config.use_cache = False`` in a manual loop): with a cache transformers does not look
      for packed sequences and the examples would attend to each other.
    - ``packing=False``: pad to the longest example; ``attention_mask`` marks the padding and
      padded labels are ``-100``.
    """
    if tokenizer.pad_token is None:
        # Many base-model tokenizers (Llama 3, Mistral) have no pad token. Padded positions are masked
        # out of attention and of the loss, so which id fills them does not matter; eos is always there.
        tokenizer.pad_token = tokenizer.eos_token
    if packing:
        from hf_scale.train.data.packing import PackedCollator

        return PackedCollator(tokenizer.pad_token_id, pad_to=pad_to, varlen_kwargs=varlen_kwargs)
    return DataCollatorForSeq2Seq(
        tokenizer, label_pad_token_id=IGNORE_INDEX, padding="longest", return_tensors="pt"
    )


def make_train_dataloader(
    dataset: datasets.Dataset,
    collator,
    micro_batch_size: int,
    seed: int,
    num_workers: int = 0,
    *,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
) -> DataLoader:
    """A shuffling DataLoader of micro-batches, meant to go through ``accelerator.prepare``.

    Prepare it with ``DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed)`` and call
    ``dataloader.set_epoch(epoch)`` at the start of every epoch. accelerate then draws one
    permutation per epoch (seed + epoch: same on every rank, different every epoch) and hands whole
    micro-batches round-robin to the ranks, so the ranks see disjoint samples. Pass ``data_seed``
    (or call ``accelerate.utils.set_seed`` on every rank): otherwise accelerate re-seeds this
    sampler from each process's ``torch.initial_seed()``, and ranks with different seeds would
    overlap.

    The tail: nothing is dropped (``drop_last=False``). With accelerate's default
    ``even_batches=True``, when the number of micro-batches is not a multiple of the number of
    ranks, or the last one is short, the last micro-batches are completed with samples from the
    start of the same epoch's order, so every rank runs the same number of full micro-batches and
    up to ``num_processes * micro_batch_size - 1`` samples are seen twice in that epoch.

    The loader flags are the Trainer's (--dataloader_num_workers, --dataloader_pin_memory,
    --dataloader_prefetch_factor, --dataloader_persistent_workers): collation runs in worker processes
    and batches are copied from pinned memory, so the next micro-batch is ready when a step ends.
    """
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=RandomSampler(dataset, generator=generator),
        collate_fn=collator,
        drop_last=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
    )


def default_dataloader_workers(cuda: bool, local_processes: int, cores: int | None) -> int:
    """--dataloader_num_workers when not given: 2 per GPU process when the cores allow (collation and the
    host-to-device copy overlap the step), none on CPU-only runs (the cores are busy training)."""
    if not cuda:
        return 0
    return max(0, min(2, (cores or 1) // max(1, local_processes) - 1))


def count_target_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that contribute to the loss, counted exactly as the Trainer counts ``num_items_in_batch``.

    transformers' ``ForCausalLMLoss`` shifts labels left by one (logit ``t`` predicts label ``t+1``),
    so label 0 of each row is never a target: count ``labels[..., 1:] != -100``.
    """
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())



def micro_batch_per_rank(dataloader, num_processes: int) -> int | None:
    """Rows one rank's micro-batches hold, as accelerate's prepared loader reports them (what the runtime guard
    compares with --per_device_train_batch_size): its total over the ranks, split; None when unknown (a loader
    accelerate did not prepare) or split_batches (the total is one rank's batch cut in pieces)."""
    total = getattr(dataloader, "total_batch_size", None)
    if total is None or getattr(dataloader, "split_batches", False):
        return None
    return total // num_processes
