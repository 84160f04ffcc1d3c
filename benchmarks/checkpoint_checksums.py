"""What the checkpoint checksums cost: hashing throughput, and hf_scale's seal/verify against writing the files.

A synthetic checkpoint (`--files` files of random bytes, `--size-mb` in all, like one rank's share of the
optimizer partitions) is written, flushed (fsync), sealed (`checkpoint.seal`: fsync + XXH3-128 of every
file + the manifest) and verified (`checkpoint_verification.verify`), in one process, `--reps` times; the hash functions
alone are timed on the same bytes in memory. The files are read back from the page cache (they were just
written): on a real cluster a save reads them back the same way, while a resume reads from disk, where the
disk's read bandwidth is the bound whatever the hash. Each rank hashes its own share of a checkpoint in
parallel (hf_scale/contract/checkpoint_integrity.py), so the per-rank cost is what this measures for `--size-mb`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import common
import xxhash

RESULTS = common.RESULTS_DIR / "checkpoint_checksums.json"
HASHES = {"xxh3_128": xxhash.xxh3_128, "blake2b": hashlib.blake2b, "sha256": hashlib.sha256}
ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)


def hash_throughput(data: bytes, reps: int) -> dict[str, float]:
    """GB/s of each hash over `data` (in memory), best of `reps`."""
    view = memoryview(data)
    chunk = 8 << 20
    result = {}
    for name, make in HASHES.items():
        best = float("inf")
        for _ in range(reps):
            hasher = make()
            start = time.perf_counter()
            for offset in range(0, len(view), chunk):
                hasher.update(view[offset : offset + chunk])
            best = min(best, time.perf_counter() - start)
        result[name] = len(data) / best / 1e9
    return result


def write_checkpoint(directory: Path, data: bytes, files: int) -> float:
    """Write `data` split into `files` files and fsync them (what a save costs before any checksum); seconds."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    size = len(data) // files
    start = time.perf_counter()
    for i in range(files):
        with open(directory / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt", "wb") as handle:
            handle.write(data[i * size : (i + 1) * size])
            handle.flush()
            os.fsync(handle.fileno())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024, help="bytes of the synthetic checkpoint (default 1024)")
    parser.add_argument("--files", type=int, default=8, help="files it is split into (default 8)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; the best is kept (default 3)")
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "checkpoint_checksums")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.files < 1 or args.reps < 1:
        parser.error("--size-mb, --files and --reps must be >= 1")

    sys.path.insert(0, str(common.REPO))
    from hf_scale.contract import checkpoint_verification
    from hf_scale.train.checkpoint import store

    environment = common.environment()
    data = os.urandom(args.size_mb << 20)
    gigabytes = len(data) / 1e9
    hashes = hash_throughput(data, args.reps)
    write_s, seal_s, verify_s = [], [], []
    directory = args.workdir / "checkpoint-1"
    for _ in range(args.reps):
        write_s.append(write_checkpoint(directory, data, args.files))
        start = time.perf_counter()
        store.seal(directory, 1, ONE_PROCESS)
        seal_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert checkpoint_verification.verify(directory, ONE_PROCESS) is None
        verify_s.append(time.perf_counter() - start)
    shutil.rmtree(args.workdir, ignore_errors=True)

    results = {
        "hash_gb_per_s": hashes,
        "write_fsync_s_per_gb": min(write_s) / gigabytes,
        "seal_s_per_gb": min(seal_s) / gigabytes,
        "verify_s_per_gb": min(verify_s) / gigabytes,
        "seal_vs_write": min(seal_s) / min(write_s),
    }
    print(common.format_table(["hash", "GB/s (memory)"], [[k, v] for k, v in hashes.items()]))
    print(common.format_table(
        ["step", "s per GB"],
        [["write + fsync", results["write_fsync_s_per_gb"]], ["seal (fsync + xxh3_128 + manifest)",
         results["seal_s_per_gb"]], ["verify (xxh3_128)", results["verify_s_per_gb"]]]))
    print(f"seal / write: {results['seal_vs_write']:.3f}")
    payload = {"environment": environment, "setup": {"size_mb": args.size_mb, "files": args.files,
               "reps": args.reps}, "results": results,
               "runs": {"write_s": write_s, "seal_s": seal_s, "verify_s": verify_s}}
    print(f"wrote {common.write_results(args.output, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
