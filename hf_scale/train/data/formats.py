"""Which of the three dataset formats a source is, and which of its rows can be used.

The format comes from the column flags, else from the column names (see pipeline.py's docstring for the
formats); with it, whether the loss is completion-only, whether the tokenizer can encode it, and each row's
problem (a missing or null column, a value that is not text, an empty text or response, a chat message
without role or content): rows that cannot be used are counted, never replaced by empty text.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import datasets
import numpy as np

from hf_scale.contract.data_arguments import DataArguments
from hf_scale.errors import UserError

logger = logging.getLogger(__name__)


DatasetFormat = Literal["text", "prompt_response", "messages"]


# Auto-detected column names, in order of preference; any prompt name pairs with any response name.
PROMPT_COLUMNS = ("instruction", "prompt", "question")


RESPONSE_COLUMNS = ("response", "completion", "answer")


MESSAGES_COLUMN = "messages"


TEXT_COLUMN = "text"


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class ResolvedFormat:
    """A dataset format together with the columns it reads."""

    kind: DatasetFormat
    columns: tuple[str, ...]


def column_list(column_names: list[str]) -> str:
    return ", ".join(column_names) if column_names else "(none)"


def _require_column(flag: str, name: str, column_names: list[str]) -> None:
    if name not in column_names:
        raise UserError(f"--{flag} {name}: no such column; available: {column_list(column_names)}")


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
            raise UserError(f"--{missing} is needed too; available columns: {column_list(column_names)}")
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
        f"cannot tell the dataset format from its columns ({column_list(column_names)}); pass --text_column, "
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


def check_tokenizer(tokenizer: Any, kind: DatasetFormat, completion_only: bool) -> None:
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
