"""Writing output files so that a reader never sees half of one, and a failure leaves nothing behind.

Files are created with the user's umask applied (like any file a shell command creates); scripts get the
execute bits the umask allows.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from hf_scale.errors import UserError
from hf_scale.files.reading import read_bytes


def current_umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


def file_mode(*, executable: bool = False) -> int:
    """What ``open()``/``touch`` would give a new file under the current umask (+x for scripts)."""
    return (0o777 if executable else 0o666) & ~current_umask()


def _write_new(path: Path, text: str | bytes, mode: int) -> None:
    if isinstance(text, bytes):  # a binary file (hf_scale's source archive for the cluster targets)
        with open(path, "xb") as handle:
            handle.write(text)
    else:
        with open(path, "x", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
    os.chmod(path, mode)  # mkstemp-style 0600 would ignore the umask; chmod after writing sets it exactly


def write_text_atomically(path: Path, text: str, *, executable: bool = False) -> None:
    """Write to a temporary file beside `path`, then rename it into place; an OSError is a UserError."""
    write_files_together(path.parent, {path.name: text}, executable={path.name} if executable else set())


def _missing_dirs(root: Path, rel_paths: list[str]) -> list[Path]:
    dirs = {root} | {root / parent for rel in rel_paths for parent in Path(rel).parents if str(parent) != "."}
    missing = {d for d in dirs if not d.is_dir()}
    missing |= {parent for d in missing for parent in d.parents if not parent.is_dir()}
    return sorted(missing, key=lambda d: len(d.parts))


def write_files_together(
    root: Path, files: dict[str, str] | dict[str, str | bytes], *, executable: set[str] = frozenset()
) -> None:
    """Write ``files`` (path relative to ``root`` -> text, or bytes for a binary file) so that either all of
    them are in place or none is changed: everything is written into a staging directory inside ``root``
    first (a full disk fails there), then renamed into place (same file system: no data is written). On any
    failure the renames already done are undone and the directories created for them removed. An OSError is a
    UserError."""
    created: list[Path] = []
    staging: Path | None = None
    done: list[tuple[Path, Path | None]] = []  # (target, backup of the file it replaced)
    current = "the output directory"
    try:
        for directory in _missing_dirs(root, list(files)):
            current = str(directory)
            directory.mkdir()
            created.append(directory)
        current = str(root)
        staging = Path(tempfile.mkdtemp(prefix=".hf-scale-staging-", dir=root))
        staged = {}
        for index, (rel, text) in enumerate(files.items()):
            current = str(root / rel)
            staged[rel] = staging / str(index)
            _write_new(staged[rel], text, file_mode(executable=rel in executable))
        for index, rel in enumerate(files):
            target = root / rel
            current = str(target)
            backup = None
            if target.exists():
                backup = staging / f"{index}.replaced"
                try:
                    os.link(target, backup)  # no data written
                except OSError:
                    shutil.copy2(target, backup)
            os.replace(staged[rel], target)
            done.append((target, backup))
    except BaseException as error:
        for target, backup in reversed(done):
            with contextlib.suppress(OSError):
                os.replace(backup, target) if backup else target.unlink()
        done.clear()
        if isinstance(error, OSError):
            raise UserError(f"cannot write {current}: {error.strerror or error}; nothing was written") from None
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if len(done) < len(files):
            for directory in reversed(created):
                with contextlib.suppress(OSError):
                    directory.rmdir()


def check_output_file(path: Path, flag: str) -> None:
    """Refuse an output path that cannot become a file, before any work is done."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise UserError(f"{flag} {path}: exists and is not a regular file")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {path}: {parent} is not a directory")
            break


def already_written(path: Path, content: str | bytes, *, force: bool, flag: str | None = None,
                    choose: str = "another file name") -> bool:
    """Whether ``path`` already holds exactly ``content`` (nothing to write). A file with other content is refused
    unless ``force``: a hand-edited file is never lost silently. ``flag``: the option that named the path, for the
    message. Never blocks on a FIFO; a file that is not UTF-8 text simply differs."""
    if not (path.exists() or path.is_symlink()):
        return False
    if read_bytes(path, flag or "existing file") == (content if isinstance(content, bytes) else content.encode()):
        return True
    if not force:
        named = f"{flag} {path}" if flag else str(path)
        raise UserError(f"{named} exists with different content; pass --force to replace it, or choose {choose}")
    return False


def save_figure_atomically(fig, path: Path, **savefig_kwargs) -> None:
    """matplotlib's ``savefig`` into a temporary file beside ``path``, renamed into place with the umask's
    mode; an OSError (full disk, no permission) is a UserError and leaves nothing behind."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
        os.close(fd)
        fig.savefig(tmp, **savefig_kwargs)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
