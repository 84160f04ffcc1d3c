"""One run per output directory: an advisory lock held by the main process for the whole run.

`OUTPUT_DIR/.hf_scale.lock` is locked with `flock` before anything in OUTPUT_DIR is touched (before the
removal of interrupted saves, before metrics.jsonl). The kernel releases it when the process dies, so a
run killed with SIGKILL never blocks the next one; a second run while the first is alive stops with one
line naming the holder (pid, host and start time, written into the lock file). Only the global main
process takes it: one lock per output directory however many nodes write there (on a shared filesystem;
flock over NFS is forwarded to the server by Linux). A filesystem without locks (some Lustre mounts)
gets a warning and no lock. The file is removed when the run ends.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from hf_scale.contract import checkpoint_integrity
from hf_scale.contract.checkpoint_layout import LOCK_FILE
from hf_scale.errors import UserError

_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OutputDirLock:
    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []
        """Directories this run created for OUTPUT_DIR, deepest first (removed again if left empty)."""

    def acquire(self) -> None:
        """Take the lock, or raise a one-line UserError naming the run that holds it."""
        self._make_output_dir()
        while self.fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(os.pread(fd, 4096, 0))
                os.close(fd)
                self.release()
                raise UserError(f"--output_dir={self.output_dir}: another run is using it ({holder}); wait for it "
                                "to end or choose another --output_dir") from None
            except OSError as error:
                if error.errno not in _NO_LOCKS:
                    raise
                print(f"hf_scale: warning: the filesystem of {self.output_dir} does not support locks "
                      f"({error.strerror}); a second run in the same --output_dir would not be detected",
                      file=sys.stderr, flush=True)
            # The holder removes the file when it ends: lock the file that is at the path now, not an unlinked one.
            if _same_file(fd, self.path):
                self.fd = fd
            else:
                os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(holder) + "\n").encode(), 0)

    def _make_output_dir(self) -> None:
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise UserError(f"--output_dir={self.output_dir}: exists and is not a directory")
        missing = self.output_dir
        while not missing.exists() and missing != missing.parent:
            self.created.append(missing)
            missing = missing.parent
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self.created = []
            raise UserError(f"--output_dir={self.output_dir}: cannot be created ({error.strerror})") from None

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            self.release()
            raise UserError(f"--output_dir={self.output_dir}: not writable ({error.strerror})") from None

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while still holding it (see acquire)
            os.close(self.fd)  # releases the lock
            self.fd = None
        for directory in self.created:
            try:
                directory.rmdir()
            except OSError:
                break  # not empty: the run wrote something there
        self.created = []


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _lock_holder(raw: bytes) -> str:
    try:
        holder = json.loads(raw.decode())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "holder unknown"


_held: OutputDirLock | None = None


def acquire(output_dir: str | Path, state) -> None:
    """The global main process takes the lock; every rank learns the outcome (a refusal is the same one-line
    error on every rank). Collective."""
    global _held
    refusal = None
    if state.is_main_process:
        lock = OutputDirLock(output_dir)
        try:
            lock.acquire()
            _held = lock
        except UserError as error:
            refusal = str(error)
    refusal = checkpoint_integrity.broadcast(state, refusal)
    if refusal:
        raise UserError(refusal)


def release() -> None:
    """End of the run (also after an error): drop the lock this process holds, if any."""
    global _held
    if _held is not None:
        _held.release()
        _held = None
