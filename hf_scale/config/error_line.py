"""pydantic's multi-line validation report as the one line hf_scale prints: the dotted field, the value as the
user typed it in YAML, and what is allowed (for an unknown key: the closest allowed one and the others)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from hf_scale.knowledge.rules import is_secret_name


class UnshownValueError(ValueError):
    """A refusal whose value must not be echoed (it may hold a secret): the one line names the field, not the value."""


def show(value: Any) -> str:
    """Values as a user would type them in YAML."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 80 else repr(value[:77]) + "..."
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _section_model(root: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    model = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def one_line(error: ValidationError, root: type[BaseModel]) -> str:
    """The first problem of `error`, raised validating the model `root`, in one line (how many more, if any)."""
    errors = error.errors(include_url=False)
    first = errors[0]
    # Union/annotated members add their own tags to `loc`; keep only field names and list indexes.
    loc = [part for part in first["loc"] if isinstance(part, int) or part.isidentifier()]
    field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
    kind = first["type"]
    if kind == "extra_forbidden":
        section = _section_model(root, loc[:-1])
        allowed = sorted(section.model_fields) if section else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        where = field.rpartition(".")[0]
        hint = f"did you mean {'.'.join(filter(None, [where, close[0]]))}? " if close else ""
        where = where or "the top level"
        return f"unknown key {field}: {hint}allowed keys under {where}: {', '.join(allowed)}{more}"
    if kind == "value_error" and not loc:
        # Our own cross-field messages already name fields and values.
        return f"{first['ctx']['error']}{more}"
    message = str(first["ctx"]["error"]) if kind == "value_error" else first["msg"]
    message = message[0].lower() + message[1:] if message else message
    if (kind == "value_error" and isinstance(first["ctx"]["error"], UnshownValueError)) or any(
        isinstance(part, str) and is_secret_name(part) for part in loc
    ):  # a credential's value (cluster.env.DB_PASSWORD: 987654321) is never echoed, whatever is wrong with it
        return f"{field} is invalid: {message}{more}"
    if kind == "missing":
        return f"{field} is required{more}"
    return f"{field}={show(first['input'])} is invalid: {message}{more}"
