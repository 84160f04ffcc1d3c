"""Which compiled DeepSpeed ops a DeepSpeed config makes the run load, and whether they can load here.

DeepSpeed's C++/CUDA ops are either prebuilt at install time (``DS_BUILD_CPU_ADAM=1 pip install deepspeed``
…) or built just in time by torch.utils.cpp_extension, which needs ninja, a C++ compiler and, for CUDA ops,
nvcc plus a ``TORCH_CUDA_ARCH_LIST`` that DeepSpeed can parse. A run that needs an op it cannot build dies
before step 1 with a long traceback (issue 10: ``9.0a`` on Hopper images, nodes without nvcc). train.py
checks the ops before the model loads and `hf-scale doctor --config` says the same before a job is queued.

:func:`required_ops` is pure (the DeepSpeed 0.19 engine's choices, read from the config dict);
:func:`op_status` asks DeepSpeed's own op builders and torch's JIT loader about this machine.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field

# DeepSpeed op name -> its builder class (what deepspeed.ops.* call get_accelerator().create_op_builder with).
BUILDERS = {
    "cpu_adam": "CPUAdamBuilder",
    "cpu_adagrad": "CPUAdagradBuilder",
    "cpu_lion": "CPULionBuilder",
    "fused_adam": "FusedAdamBuilder",
    "fused_lamb": "FusedLambBuilder",
    "fused_lion": "FusedLionBuilder",
    "async_io": "AsyncIOBuilder",
    "deepspeed_shm_comm": "ShareMemCommBuilder",
}
_OFFLOAD_DEVICES = ("cpu", "nvme")
_ARCH = re.compile(r"\d+\.\d+(\+PTX)?")

FIXES = {
    "cpu_adam": "install a C++ compiler and ninja (e.g. apt-get install g++; pip install ninja), or prebuild the "
    "op (DS_BUILD_CPU_ADAM=1 pip install --force-reinstall --no-cache-dir deepspeed), or set "
    "deepspeed.torch_adam=true (torch's AdamW on the CPU: no compiler, slower)",
    "fused_adam": "drop deepspeed.fused_adam (the training loop's fused torch AdamW needs no build), or prebuild "
    "the op (DS_BUILD_FUSED_ADAM=1 pip install --force-reinstall --no-cache-dir deepspeed)",
    "async_io": "install libaio (apt-get install libaio-dev) and a C++ compiler, or prebuild the op "
    "(DS_BUILD_AIO=1 pip install --force-reinstall --no-cache-dir deepspeed), or offload to cpu instead of nvme",
    "deepspeed_shm_comm": "DeepSpeed on a machine without GPUs JIT-builds its shared-memory comm op: install a "
    "C++ compiler and ninja (apt-get install g++; pip install ninja)",
}
GENERIC_FIX = "install a C++ compiler and ninja (and nvcc for CUDA ops), or prebuild the op with DS_BUILD_*=1"


@dataclass(frozen=True)
class OpNeed:
    op: str
    """DeepSpeed's op name (its builder's NAME), e.g. cpu_adam."""
    reason: str
    """The config entry that makes DeepSpeed load it."""


@dataclass(frozen=True)
class OpStatus:
    op: str
    usable: bool
    how: str
    """prebuilt | cached JIT build | JIT build | not usable."""
    missing: list[str] = field(default_factory=list)
    """What a JIT build lacks here, one phrase each."""
    stale_lock: str | None = None
    """Why loading would wait forever on a build lock nobody holds (:func:`stale_build_lock`)."""

    @property
    def fix(self) -> str:
        return FIXES.get(self.op, GENERIC_FIX)


def _offload_device(zero: dict, key: str) -> str:
    block = zero.get(key)
    return str(block.get("device", "none")).lower() if isinstance(block, dict) else "none"


def required_ops(ds_config: dict, *, gpu: bool) -> list[OpNeed]:
    """The compiled ops DeepSpeed 0.19 loads for this config (engine._configure_basic_optimizer,
    comm/torch.py). No optimizer block: the training loop's torch optimizer, nothing to build."""
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    optimizer_device = _offload_device(zero, "offload_optimizer") if stage else "none"
    needs: list[OpNeed] = []
    optimizer = ds_config.get("optimizer")
    if isinstance(optimizer, dict):
        kind = str(optimizer.get("type", "")).lower()
        params = optimizer.get("params") or {}
        on_cpu = optimizer_device in _OFFLOAD_DEVICES
        where = f"optimizer.type={optimizer.get('type')}"
        if on_cpu:
            where += f" with zero_optimization.offload_optimizer.device={optimizer_device}"
        if kind in ("adam", "adamw") and params.get("torch_adam") is not True:
            needs.append(OpNeed("cpu_adam" if on_cpu else "fused_adam", where))
        elif kind == "lion":
            needs.append(OpNeed("cpu_lion" if on_cpu else "fused_lion", where))
        elif kind == "lamb":
            needs.append(OpNeed("fused_lamb", where))
        elif kind == "adagrad" and on_cpu:
            needs.append(OpNeed("cpu_adagrad", where))
    for key in ("offload_optimizer", "offload_param"):
        if stage == 3 and _offload_device(zero, key) == "nvme":
            needs.append(OpNeed("async_io", f"zero_optimization.{key}.device=nvme"))
            break
    if not gpu and sys.platform == "linux":
        needs.append(OpNeed("deepspeed_shm_comm", "DeepSpeed's communication backend on a machine without GPUs"))
    return needs


def arch_list_problem(value: str | None) -> str | None:
    """DeepSpeed's JIT builder reads TORCH_CUDA_ARCH_LIST as MAJOR.MINOR[+PTX] entries (int() of each part):
    torch's arch-specific `9.0a` is valid for torch and a ValueError in DeepSpeed."""
    if not value or not value.strip():
        return None
    tokens = [token.strip() for token in value.replace(" ", ";").split(";") if token.strip()]
    bad = [token for token in tokens if not _ARCH.fullmatch(token)]
    if not bad:
        return None
    suggestion = ";".join(re.sub(r"^(\d+\.\d+)[a-zA-Z]+", r"\1", token) for token in tokens)
    return (
        f"TORCH_CUDA_ARCH_LIST={value!r}: DeepSpeed's JIT build cannot parse {bad[0]!r} (it reads MAJOR.MINOR or "
        f"MAJOR.MINOR+PTX); export TORCH_CUDA_ARCH_LIST={suggestion!r} for DeepSpeed builds"
    )


def _extensions_root() -> str | None:
    """Where torch's JIT loader builds each op, in ROOT/NAME: $TORCH_EXTENSIONS_DIR, else its default root with a
    pyXY_cpu / pyXY_cuNNN folder (None with a torch whose rule is unknown)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    try:
        # The loader's own rule for the default root (private; it creates the root folder, never the op's).
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory("", verbose=False)
    except Exception:  # noqa: BLE001 - another torch: nothing known
        return None


def _cached_jit_build(name: str) -> str | None:
    # torch's JIT loader reuses an up-to-date build without compiling (ninja still runs and finds nothing to do).
    root = _extensions_root()
    directory = os.path.join(root, name) if root else None
    return directory if directory and os.path.isfile(os.path.join(directory, f"{name}.so")) else None


def _holders(path: str) -> list[int] | None:
    """The processes of this machine (that this user may inspect) with ``path`` open; None where /proc cannot say."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target, found = os.path.realpath(path), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in fds):
                found.append(int(pid))
        except OSError:  # gone, or another user's
            continue
    return found


LOCK_SETTLE_S = 1.0
"""How long a lock nobody holds must stay before it is called stale (see :func:`stale_build_lock`)."""


def _unheld_lock(lock: str) -> os.stat_result | None:
    """The lock file's stat when it exists and no process here holds it open; None otherwise (or without /proc)."""
    try:
        found = os.stat(lock)
    except OSError:
        return None
    return found if _holders(lock) == [] else None


def stale_build_lock(name: str, now: float | None = None) -> str | None:
    """Why torch's JIT build of the op ``name`` would wait forever here (None when it would not): its build folder's
    ``lock`` (torch.utils.cpp_extension's FileBaton: created with O_EXCL by the process that builds or checks a cached
    build, which holds it open and removes it when done; every other loader polls until it is gone, without a word)
    exists and no process on this machine holds it: a run killed while building left it.

    Looked at twice, LOCK_SETTLE_S apart: torch's release closes the file before it removes it, so the ranks of one
    run, each loading the op in turn, leave moments where a live lock is held by nobody (seen on 4 ranks of 2 cores).
    A lock is stale only when the same file is still there, still unheld."""
    root = _extensions_root()
    lock = os.path.join(root, name, "lock") if root else None
    first = _unheld_lock(lock) if lock else None
    if first is None:  # no lock, a build in progress (or no /proc): torch's wait is right
        return None
    time.sleep(LOCK_SETTLE_S)
    again = _unheld_lock(lock)
    if again is None or (again.st_ino, again.st_mtime_ns) != (first.st_ino, first.st_mtime_ns):
        return None
    since = first.st_mtime
    age_s = max(0, int((time.time() if now is None else now) - since))
    stamp = datetime.datetime.fromtimestamp(since, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (f"torch's JIT-build lock {lock} exists since {stamp} ({age_s // 3600} h {age_s % 3600 // 60} min ago) and "
            f"no process on this machine holds it (a run killed while building {name} left it): every run that loads "
            f"{name} would wait on it forever, without output; remove it (rm {lock}) unless another machine sharing "
            f"{root} is building {name} right now")


def op_status(op: str) -> OpStatus:
    """Can DeepSpeed load `op` on this machine? Prebuilt, a cached JIT build, or a JIT build with what's here."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, probe_is_compatible
    from torch.utils.cpp_extension import CUDA_HOME, get_cxx_compiler, is_ninja_available

    accelerator = get_accelerator()
    if installed_ops.get(op) and accelerator_name == accelerator._name:
        return OpStatus(op, True, "prebuilt")
    builder = accelerator.create_op_builder(BUILDERS.get(op, op))
    if builder is None:
        return OpStatus(op, False, "not usable", [f"DeepSpeed has no {op} op for the {accelerator._name} accelerator"])
    lock = stale_build_lock(builder.name)  # a cached build too goes through the lock: torch takes it to check
    if lock:
        return OpStatus(op, False, "locked", stale_lock=lock)
    missing: list[str] = []
    if not probe_is_compatible(builder):
        detail = " ".join(str(getattr(builder, "error_log", "") or "").split())
        missing.append("DeepSpeed reports the op incompatible with this machine" + (f" ({detail})" if detail else ""))
    if not is_ninja_available():
        missing.append("ninja (pip install ninja)")
    cached = _cached_jit_build(builder.name)
    if cached and not missing:
        return OpStatus(op, True, f"cached JIT build in {cached}")
    compiler = os.environ.get("CXX") or get_cxx_compiler()
    if not shutil.which(compiler):
        missing.append(f"a C++ compiler ({compiler} is not on PATH)")
    if isinstance(builder, CUDAOpBuilder) and torch.cuda.is_available():
        if not CUDA_HOME or not os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
            missing.append("nvcc (no CUDA toolkit found: set CUDA_HOME)")
        problem = arch_list_problem(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        if problem:
            missing.append(problem)
    return OpStatus(op, not missing, "JIT build" if not missing else "not usable", missing)


def check_config_ops(ds_config: dict, source: str, *, gpu: bool) -> list[str]:
    """One sentence per op the config needs that cannot load here (empty: everything loads)."""
    problems = []
    for need in required_ops(ds_config, gpu=gpu):
        status = op_status(need.op)
        if status.stale_lock:
            problems.append(f"{source}: {need.reason} needs DeepSpeed's {need.op} op, but {status.stale_lock}")
        elif not status.usable:
            problems.append(
                f"{source}: {need.reason} needs DeepSpeed's {need.op} op, which is not prebuilt and cannot be "
                f"JIT-built here (missing: {', '.join(status.missing)}); fix: {status.fix}"
            )
    return problems
