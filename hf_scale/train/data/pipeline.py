"""Data pipeline of train.py: load one source, then tokenize it with label masking.

Three dataset formats are understood (column names are auto-detected or given explicitly):

- ``text``: one column of plain text; every token is a target.
- ``prompt_response``: a prompt column and a response column (instruction/response,
  prompt/completion or question/answer); the tokens are ``bos + prompt + response + eos``.
- ``messages``: a list of ``{"role", "content"}`` dicts rendered by the tokenizer's chat template.

With completion-only loss (the default for the last two formats) only response/assistant tokens
are targets; the rest carry label ``-100``. Batches are either padded to the longest example or,
with ``--packing``, rows packed to a token budget (hf_scale.train.data.packing).

The flags are `arguments.py`'s; which format a source is and which rows are usable, `formats.py`; several
sources and the validation set, `sources.py`; batches, `batches.py`.
"""

from __future__ import annotations

import csv
import logging
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import jinja2

from hf_scale import quiet
from hf_scale.contract.data_arguments import DataArguments
from hf_scale.contract.embedded_assets import EMBEDDED_DATA_FILE
from hf_scale.errors import UserError
from hf_scale.files.reading import not_a_regular_file
from hf_scale.train.data import json_rows
from hf_scale.train.data.formats import (
    ResolvedFormat,
    check_tokenizer,
    column_list,
    drop_bad_rows,
    resolve_completion_only,
    resolve_format,
)
from hf_scale.train.data.labels import IGNORE_INDEX

logger = logging.getLogger(__name__)


# File extension -> `datasets` packaged builder.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _one_source(flag: str, values: list[str] | None) -> str | None:
    if values is not None and len(values) > 1:
        raise ValueError(f"--{flag}: {len(values)} sources; hf_scale.train.data.sources loads them one by one")
    return values[0] if values else None


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
    # datasets logs "Failed to load JSON from file ..." before it raises: held, and dropped with the refusal.
    with quiet.held("datasets"):
        try:
            kwargs = {"features": _csv_text_features(path)} if builder == "csv" else {}
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
        except OSError as error:
            raise UserError(f"--{flag} {path_str}: cannot be read ({error.strerror or error})") from None
        except (datasets.exceptions.DatasetsError, ValueError) as error:
            if "corresponds to no data" in str(error):  # datasets' words for a file with no rows ("[]", a header)
                raise empty from error
            # datasets wraps the parser's error (JSON/CSV syntax, ...); the cause is what the user can fix, and for
            # JSON the line that is no row object, found by reading the file again (pyarrow names a block's row).
            detail = (json_rows.first_problem(path) if builder == "json" else None) or (error.__cause__ or error)
            raise UserError(f"--{flag} {path_str}: could not be read as {builder}: {detail}") from error
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
            f"available: {column_list(list(loaded))}"
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
    check_tokenizer(tokenizer, fmt.kind, completion_only)
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


