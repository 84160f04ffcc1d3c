"""The data model of `hf-scale check`: a :class:`Finding` (severity, code, file:key, problem, fix, values), the
settings compared across files (:class:`Source`) and the helpers that phrase problems and fixes.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_scale.check.codes import ERROR, WARNING, severity_problem

TRAINING_ARGS = "training args"
"""The ``file`` of findings about the training arguments given after ``--``."""




@dataclass(frozen=True)
class Finding:
    """One problem: where it is, what disagrees, how to fix it."""

    severity: str
    """``error`` (the job fails or silently does something else) or ``warning`` (risky, may be intended)."""
    code: str
    """Stable identifier, e.g. ``grad-accum-mismatch``: an entry of hf_scale.check.codes.CATALOGUE (with a severity
    it allows), checked when the finding is made, so a misspelled code fails every test that reaches it."""
    file: str
    """The file the problem is in (as given on the command line), or ``training args``."""
    key: str
    """Dotted key path inside ``file`` (a flag for training args)."""
    problem: str
    fix: str
    values: dict[str, Any] = field(default_factory=dict)
    """``file:key`` -> value for every value involved (the disagreeing ones)."""

    def __post_init__(self) -> None:
        problem = severity_problem(self.code, self.severity)
        if problem:
            raise ValueError(problem)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.key}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A misspelling is close to the key it means (difflib ratio >= 0.8: `overlap_com`, `zero3_init_flg`,
# `gradient_acumulation_steps`); below that a suggestion names an unrelated key (`_comment` -> `comet`).
_SUGGESTION_CUTOFF = 0.8


def is_comment_key(key: Any) -> bool:
    """`_comment`, `_read_the_docs`, `comment`, `__notes`: keys people add to explain a JSON file."""
    return isinstance(key, str) and (key.startswith("_") or "comment" in key.lower())


def closest(name: str, known: Any) -> str | None:
    if is_comment_key(name):
        return None
    matches = difflib.get_close_matches(name, sorted(known), n=1, cutoff=_SUGGESTION_CUTOFF)
    return matches[0] if matches else None


def ignored_key_severity(name: str, known: Any) -> str:
    """A key the library ignores silently: an error when it is a misspelling of a key it reads (the setting
    written does not happen), a warning for a foreign key (e.g. another tool's `monitor_config`)."""
    return ERROR if closest(name, known) else WARNING


def in_file(file: str) -> str:
    """The start of a fix text: which file to edit."""
    return f"In {Path(file).name}, "


def rename_fix(name: str, known: Any, what: str, file: str) -> str:
    suggestion = closest(name, known)
    if suggestion:
        return f"{in_file(file)}rename `{name}` to `{suggestion}` (the closest {what})."
    return f"{in_file(file)}remove `{name}`; it is not a {what}."


@dataclass(frozen=True)
class Source:
    file: str
    key: str
    value: Any

    @property
    def where(self) -> str:
        return f"{self.file}:{self.key}"

    @property
    def label(self) -> str:
        """Short form for problem texts: the file's name and the key (just the flag for training args)."""
        return self.key if self.file == TRAINING_ARGS else f"{Path(self.file).name}:{self.key}"


def disagreement(
    code: str, what: str, sources: list[Source], fix: str, severity: str = ERROR, note: str = ""
) -> Iterator[Finding]:
    """One finding (an error unless told) when the known values of the same setting differ."""
    if len({repr(s.value) for s in sources}) > 1:
        listing = ", ".join(f"{s.label}={s.value!r}" for s in sources)
        yield Finding(
            severity,
            code,
            sources[0].file,
            sources[0].key,
            f"{what} disagrees: {listing}.{note}",
            fix,
            {s.where: s.value for s in sources},
        )


def agree_fix(sources: list[Source], hint: str = "") -> str:
    """"Make a.yaml:key, b.json:key and --flag equal" — every place that holds one of the values."""
    places = [s.key.split(" ")[0] if s.file == TRAINING_ARGS else s.label for s in sources]
    listing = ", ".join(places[:-1]) + f" and {places[-1]}" if len(places) > 1 else places[0]
    return f"Make {listing} equal{hint}."

