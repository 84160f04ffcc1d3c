"""Writing output files so that a reader never sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hf_scale.errors import UserError


def write_text_atomically(path: Path, text: str, *, executable: bool = False) -> None:
    """Write to a temporary file beside `path`, then rename it into place; an OSError is a UserError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
                handle.write(text)
            os.chmod(tmp, 0o755 if executable else 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror or error}") from None
