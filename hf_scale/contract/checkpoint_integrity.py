"""Checksums of checkpoint files, computed and verified by every rank in parallel.

A checkpoint of a 70B model holds about 1 TB across the ranks (16-bit weights, fp32 master weights and
two Adam moments: ~14 bytes per parameter). One process hashing all of it at 1-2 GB/s of disk reads
would add 10-15 minutes to every save and to every resume. So the work is shared: the main process
lists the files, the list is cut into `num_processes` shares of about equal bytes (largest file first
to the least loaded rank), every rank flushes and hashes its share, and the digests are gathered. A save
then costs about `checkpoint bytes / num_processes` of reading per rank (from the page cache when the
rank reads what its node just wrote), a resume the same from disk.

The hash is xxHash's XXH3-128 (the `xxhash` package, already a dependency of `datasets`): it detects
corruption (flipped bits, truncation, a file swapped for another), not tampering, at memory speed
(~10 GB/s per core here), so the disk stays the bound. hashlib's blake2b, the standard library's
fastest, runs at ~1 GB/s per core: the slower choice would make the CPU the bound.
"""

from __future__ import annotations

import heapq
import os
from pathlib import Path

import xxhash

HASH_NAME = "xxh3_128"
_CHUNK = 8 << 20


def file_digest(path: Path, *, fsync: bool = False) -> str:
    """XXH3-128 of a file's bytes (hex); with `fsync`, flush the file to disk first."""
    hasher = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        if fsync:
            os.fsync(handle.fileno())
        while n := handle.readinto(buffer):
            hasher.update(view[:n])
    return hasher.hexdigest()


def shares(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """Split file names into `parts` lists of about equal total size (largest first to the least loaded)."""
    heap = [(0, rank) for rank in range(parts)]
    out: list[list[str]] = [[] for _ in range(parts)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        out[rank].append(name)
        heapq.heappush(heap, (load + sizes[name], rank))
    return out


def broadcast(state, obj):
    """`obj` of the main process on every rank (`state`: accelerate's PartialState or Accelerator)."""
    if state.num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([obj])[0]


def gather(state, obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if state.num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])


def digests(root: Path, sizes: dict[str, int], state, *, fsync: bool = False) -> dict[str, str]:
    """Digest of every file named in `sizes` (relative to `root`), each rank hashing one share. Collective."""
    mine = shares(sizes, state.num_processes)[state.process_index]
    local = {name: file_digest(root / name, fsync=fsync) for name in mine}
    merged: dict[str, str] = {}
    for part in gather(state, local):
        merged.update(part)
    return merged
