"""Reading what a user hands to a command: files, YAML and JSON, strictly and with bounded cost.

Every problem is a one-line :class:`~hf_scale.errors.UserError` naming the input: a missing file, a
directory or FIFO given as a file (refused before anything blocks on it), an unreadable or oversized
file, bytes that are not UTF-8, duplicate keys (YAML and JSON alike would silently keep the last one),
YAML alias bombs (refused before the document is built), ``NaN``/``Infinity`` or a number that overflows
to infinity in JSON (not JSON, and DeepSpeed/accelerate would run with it), and YAML's ``.inf``/``.nan`` (no
count, size, port or rate of any config is infinite: each reader would crash on int() or run with it).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from hf_scale.errors import UserError

MAX_CONFIG_BYTES = 4 * 2**20
"""Config files (YAML, JSON) are a few KiB; anything this large is not one."""
MAX_YAML_ALIASES = 100
MAX_YAML_NODES = 100_000
"""A config has a few hundred nodes: these bound what a document may expand to (alias bombs)."""

NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:\s*[a-z]+)?$|^-(?:inf|infinity|nan)$",
                             re.IGNORECASE)
"""What argparse must read as a negative number, not as a flag (set as a parser's ``_negative_number_matcher``):
Python 3.11's own pattern misses exponents, so `--adam_epsilon -1e-8` was "expected one argument", and sizes
(`--gpu-memory -80GB`: a number with a unit). Read as a value, the flag's own range check answers. No option of
hf_scale's starts with a dash and a digit, so nothing this matches could be a flag."""

_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str | None:
    """What a file of this mode is, when it is not a regular file (None when it is)."""
    return "a directory" if stat.S_ISDIR(mode) else next((k for test, k in _FILE_KINDS if test(mode)), None)


def not_a_regular_file(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a file ("no such file", "is a directory, not a regular file", "is a
    character device, not a regular file", ...), or None for a regular file (links followed). For inputs that
    a library opens itself (datasets, transformers): /dev/zero or a FIFO would make it read forever."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as error:
        return f"cannot be opened ({error.strerror or error})"
    kind = _kind(mode)
    return None if kind is None else f"is {kind}, not a regular file"


def read_bytes(path: str | Path, what: str, *, max_bytes: int = MAX_CONFIG_BYTES, expected: str = "") -> bytes:
    """The content of a regular file. Opened without blocking, so a FIFO is refused, not waited on.
    ``expected`` (e.g. "a DeepSpeed JSON config") ends the line when the path is missing or not a file."""
    path = Path(path)
    allowed = f"; expected {expected}" if expected else ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UserError(f"{what} {path}: not found{allowed}") from None
    except PermissionError:
        raise UserError(f"{what} {path}: permission denied (cannot read it)") from None
    except OSError as error:
        raise UserError(f"{what} {path}: cannot be opened ({error.strerror or error})") from None
    kind = _kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise UserError(f"{what} {path}: is {kind}, not a regular file{allowed}")
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(max_bytes + 1)
        except OSError as error:
            raise UserError(f"{what} {path}: cannot be read ({error.strerror or error})") from None
    if len(data) > max_bytes:
        raise UserError(f"{what} {path}: larger than the {max_bytes} bytes allowed")
    return data


def decode_utf8(data: bytes, where: str) -> str:
    """UTF-8 text (a leading byte-order mark is dropped); one line naming the first bad byte otherwise."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise UserError(
            f"{where}: not UTF-8 text (byte 0x{data[error.start]:02x} at line {line}); save it as UTF-8"
        ) from None


def read_text(path: str | Path, what: str, *, max_bytes: int = MAX_CONFIG_BYTES, expected: str = "") -> str:
    """A regular UTF-8 text file's content, or a one-line UserError that says what is wrong with it."""
    return decode_utf8(read_bytes(path, what, max_bytes=max_bytes, expected=expected), f"{what} {path}")


# --- YAML ------------------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that counts aliases while composing and refuses duplicate keys while constructing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                mark = self.peek_event().start_mark
                raise _Refused(f"more than {MAX_YAML_ALIASES} aliases (*name)", mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then overriding keys is what merge keys are for
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:
                continue  # an unhashable key: SafeLoader reports it below
            if first is not key_node.start_mark:
                raise _Refused(f"duplicate key {key!r} (first at line {first.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


def _expanded_size(node: yaml.Node, memo: dict[int, int], active: set[int]) -> int:
    """Nodes the document expands to once aliases are copied out (what a consumer walks)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise _Refused("an alias refers to the collection it is in (a recursive document)", node.start_mark)
    active.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, memo, active) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo, active) + _expanded_size(v, memo, active) for k, v in node.value)
    active.discard(key)
    memo[key] = min(size, MAX_YAML_NODES + 1)
    return memo[key]


def load_yaml(text: str, where: str, *, finite: bool = True) -> Any:
    """Parse one YAML document strictly; ``where`` names it in the one-line error. ``finite=False`` lets `.inf`
    through, for a value whose reader names its own field and range (`hf-scale generate --set KEY=VALUE`)."""
    return _load(text, where, lambda loader: [loader.get_single_node()], finite)[0]


def load_yaml_documents(text: str, where: str) -> list[Any]:
    """Every document of a YAML stream (``---`` between them: a TrainingRuntime and its TrainJob, a SkyPilot job
    group), each read as strictly as :func:`load_yaml`; empty documents are left out."""
    def nodes(loader: _StrictLoader) -> list[yaml.Node | None]:
        found = []
        while loader.check_node():
            found.append(loader.get_node())
        return found

    return [document for document in _load(text, where, nodes) if document is not None]


def _load(text: str, where: str, nodes: Any, finite: bool = True) -> list[Any]:
    loader = _StrictLoader(text)
    try:
        documents = []
        for node in nodes(loader):
            if node is None:
                documents.append(None)
                continue
            if _expanded_size(node, {}, set()) > MAX_YAML_NODES:
                raise _Refused(f"expands to more than {MAX_YAML_NODES} values (aliases copied out)", node.start_mark)
            document = loader.construct_document(node)
            found = _first_not_finite(document) if finite else None
            if found:
                raise UserError(f"{where}: {found[0]}={found[1]} is not a finite number (no count, size, port or "
                                "rate is infinite; write the number)")
            documents.append(document)
        return documents
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise UserError(f"{where}: not valid YAML{at}: {problem}") from None
    except RecursionError:
        raise UserError(f"{where}: not valid YAML: nested too deeply") from None
    except ValueError as error:  # e.g. an integer with more digits than Python converts
        raise UserError(f"{where}: not valid YAML: {' '.join(str(error).split())[:160]}") from None
    finally:
        loader.dispose()


# --- JSON ------------------------------------------------------------------------------------------------


class _NotFinite:
    def __init__(self, text: str) -> None:
        self.text = text


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _float(text: str) -> float | _NotFinite:
    value = float(text)
    return value if value not in (float("inf"), float("-inf")) else _NotFinite(text)


def _first_not_finite(node: Any, path: str = "") -> tuple[str, str] | None:
    """(dotted path, as written) of the first NaN or infinity: JSON's constants, YAML's ``.inf``/``.nan``."""
    if isinstance(node, _NotFinite):
        return path or "(top level)", node.text
    if isinstance(node, float) and not math.isfinite(node):
        return path or "(top level)", {"inf": ".inf", "-inf": "-.inf"}.get(str(node), ".nan")
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        found = _first_not_finite(child, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".lstrip("."))
        if found:
            return found
    return None


def load_json(text: str, where: str) -> Any:
    """Parse JSON strictly: no duplicate keys, no NaN/Infinity, no number that overflows to infinity."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_NotFinite, parse_float=_float)
    except json.JSONDecodeError as error:
        raise UserError(f"{where}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}") from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON: nested too deeply") from None
    except ValueError as error:
        raise UserError(f"{where}: not valid JSON: {' '.join(str(error).split())[:160]}") from None
    found = _first_not_finite(data)
    if found:
        raise UserError(f"{where}: {found[0]}={found[1]} is not a finite number (JSON has no NaN or Infinity)")
    return data


MISSING = object()
"""get_path's default: the key is absent (None is a value a file may hold)."""


def get_path(mapping: Any, dotted: str, default: Any = MISSING) -> Any:
    """The value at a dotted key (`zero_optimization.stage`) of a parsed YAML/JSON mapping, or `default`."""
    node = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
