"""The first line of a JSON / JSON Lines data file that is no row, in words a user can act on.

datasets reads JSON with pyarrow, whose errors name neither the line nor what a row must be ("Column()
changed from object to number in row 0", "Trailing data", "Column(/text) was specified twice in row 0").
Once datasets has refused a file, it is read again here, line by line (JSON Lines) or whole (one JSON
array), to name the first line that is no JSON object, is no JSON at all, or repeats a key. Only on that
failure path: a file datasets accepts is never read twice.
"""

from __future__ import annotations

import json
from pathlib import Path

ROW = 'each row must be a JSON object such as {"text": "..."} or {"prompt": "...", "response": "..."}'


class _DuplicateKey(ValueError):
    pass


def _object(pairs: list[tuple[str, object]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "null" if value is None else type(value).__name__


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _judge(text: str, where: str) -> str | None:
    """What is wrong with one JSON value meant to be a row (None: a row)."""
    try:
        value = json.loads(text, object_pairs_hook=_object)
    except _DuplicateKey as key:
        return f"{where} has the key {str(key)!r} twice; each key once per row"
    except json.JSONDecodeError as error:
        return f"{where} is not valid JSON ({error.msg} at column {error.colno}); {ROW}"
    if not isinstance(value, dict):
        return f"{where} is {_kind(value)} ({_shown(value)}), not a JSON object; {ROW}"
    return None


def first_problem(path: Path) -> str | None:
    """The first line of `path` that is no row, described; None when none is found (then the parser's words
    are the best there is) or the file is no UTF-8 text."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if path.suffix.lower() != ".jsonl" and text.lstrip().startswith("["):  # a .json file holding one array of rows
        try:
            rows = json.loads(text, object_pairs_hook=_object)
        except _DuplicateKey as key:
            return f"a row has the key {str(key)!r} twice; each key once per row"
        except json.JSONDecodeError as error:
            return f"line {error.lineno} is not valid JSON ({error.msg} at column {error.colno})"
        for index, row in enumerate(rows if isinstance(rows, list) else []):
            if not isinstance(row, dict):
                return f"element {index} of the array is {_kind(row)} ({_shown(row)}), not a JSON object; {ROW}"
        return None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            problem = _judge(line, f"line {number}")
            if problem is not None:
                return problem
    return None
