"""Precision rules that need no library: which fp8 combinations accelerate refuses (for the config and for a
hand-written accelerate YAML alike), the config's fp8 warnings, what the generated accelerate YAML says about fp8,
what a machine needs for fp8 (train.py's refusal, `doctor`) and which fp8 backends import here. Torch-free, like
hf_scale.knowledge.rules (which holds the tables); the decisions that need torch (which modules become fp8, the GPU's
capability) are hf_scale.train.model.fp8's.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from hf_scale.knowledge.rules import FP8, FP8_BACKEND_MODULES, FP8_BACKENDS, FP8_MIN_COMPUTE_CAPABILITY

# accelerate 1.15's `accelerate launch` turns each fp8_config key K into the launch argument fp8_K (or K when it
# already starts with fp8_) and exports it as ACCELERATE_FP8_*, which its recipe kwargs read
# (commands/launch.py _validate_launch_command, utils/launch.py setup_fp8_env, utils/dataclasses.py
# AORecipeKwargs/TERecipeKwargs). `accelerate config` itself writes `amax_history_length` and
# `amax_compute_algorithm`, which no launch argument takes (silently dropped): these are the names it reads.
# tests/test_fp8.py proves every key against accelerate's launch parser.
TE_RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "most_recent"}
"""TransformerEngine's delayed-scaling recipe as accelerate launches it by default, written out so the file shows
what runs."""
MSAMP_OPT_LEVEL = "O2"


def fp8_accelerate_section(cfg: Any) -> dict[str, Any]:
    """The accelerate YAML's `fp8_config` for a config with precision fp8."""
    backend = cfg.fp8.backend
    section: dict[str, Any] = {"backend": FP8_BACKENDS[backend]}
    if backend == "torchao":
        # accelerate's AORecipeKwargs defaults, explicit; the float8 all-gather only means something under FSDP2.
        section["pad_inner_dim"] = True
        section["enable_fsdp_float8_all_gather"] = cfg.strategy == "fsdp" and cfg.fsdp.version == 2
    elif backend == "te":
        section.update(TE_RECIPE)
    else:
        section["opt_level"] = MSAMP_OPT_LEVEL
    return section


RAM_EFFICIENT_LOADING = "cpu_ram_efficient_loading"
BACKEND = "backend"


@dataclass(frozen=True)
class Fp8Refusal:
    """Why an fp8 combination cannot start, in accelerate's terms; each file phrases it with its own keys."""

    change: str
    """What must change: RAM_EFFICIENT_LOADING (set it false) or BACKEND (another fp8 backend)."""
    reason: str


def fp8_refusal(backend: str, strategy: str, *, cpu_ram_efficient_loading: bool) -> Fp8Refusal | None:
    """The combinations accelerate refuses at start (None when it starts): the one place both the config
    (:func:`fp8_config_problem`) and `hf-scale check` of an accelerate YAML (hf_scale.check.fp8) ask.
    ``backend``: the config's fp8.backend; ``strategy``: single, ddp, fsdp or deepspeed."""
    if backend == "torchao" and strategy == "fsdp" and cpu_ram_efficient_loading:
        # accelerate.Accelerator.__init__ (FSDP1 and FSDP2): "torchao with FSDP2 and cpu_ram_efficient_loading is
        # not supported".
        return Fp8Refusal(RAM_EFFICIENT_LOADING, "accelerate refuses torchao's float8 layers with rank-0-only loading")
    if backend == "msamp" and strategy in ("fsdp", "deepspeed"):
        # accelerate: MS-AMP + FSDP is NotImplementedError; under DeepSpeed it needs DeepSpeed's own msamp block,
        # which accelerate adds only when the launcher exports the backend (never with a DeepSpeed config file).
        return Fp8Refusal(BACKEND, "accelerate runs MS-AMP on one process or DDP only")
    return None


def fp8_config_problem(cfg: Any) -> str | None:
    """Why a config with precision fp8 cannot run as written (None when it can), said before any file is generated."""
    refusal = fp8_refusal(cfg.fp8.backend, cfg.strategy, cpu_ram_efficient_loading=cfg.fsdp.cpu_ram_efficient_loading)
    if refusal is None:
        return None
    if refusal.change == RAM_EFFICIENT_LOADING:
        return ("precision=fp8 with fp8.backend=torchao and strategy=fsdp needs fsdp.cpu_ram_efficient_loading=false "
                f"({refusal.reason})")
    return (f"fp8.backend={cfg.fp8.backend} with strategy={cfg.strategy} is not supported ({refusal.reason}; allowed: "
            "strategy single or ddp); use fp8.backend=torchao or te")


def fp8_machine_refusal(backend: str, *, capability: tuple[int, int] | None, importable: bool) -> str | None:
    """Why FP8 with ``backend`` cannot run on a machine (None when it can): train.py's refusal before the model loads
    and `doctor --config`'s verdict. ``capability``: the GPU's compute capability, None without a GPU."""
    need = ".".join(map(str, FP8_MIN_COMPUTE_CAPABILITY))
    if capability is None:
        return (f"precision=fp8 needs a GPU of compute capability >= {need} (Ada, Hopper or later); this machine has "
                "none: use precision=bf16")
    if tuple(capability) < FP8_MIN_COMPUTE_CAPABILITY:
        return (f"precision=fp8 needs a GPU of compute capability >= {need} (Ada, Hopper or later); this GPU has "
                f"{capability[0]}.{capability[1]}: use precision=bf16")
    if not importable:
        return (f"fp8.backend={backend}: the module {FP8_BACKEND_MODULES[backend]} is not importable; install it "
                "(torchao: pip install hf-scale[fp8]) or choose another fp8.backend")
    return None


def precision_gpu_problems(precision: str | None, fp8_backend: str | None, gpus: list[dict],
                           backends: dict[str, str | None]) -> list[str]:
    """`doctor --config`: what the config's precision needs that this node's GPUs (doctor's GPU records) or
    packages (:func:`fp8_backends`) lack; the first GPU that lacks it is named. Nothing without GPUs (said apart)."""
    for gpu in gpus:
        capability = tuple(int(part) for part in gpu["compute_capability"].split("."))
        named = f"GPU {gpu['index']} ({gpu['name']}, compute capability {gpu['compute_capability']})"
        if precision == "bf16" and not gpu["bf16"]:
            return [f"precision bf16 but {named} has no bf16; use precision fp16"]
        if precision == FP8:
            installed = backends.get(fp8_backend or "torchao")
            problem = fp8_machine_refusal(fp8_backend or "torchao", capability=capability,
                                          importable=bool(installed) and not installed.startswith("broken"))
            if problem:
                return [f"{named}: {problem}"]
    return []


def fp8_config_warnings(cfg: Any) -> list[str]:
    """Legal fp8 choices that usually make it slower than bf16 (`generate` prints them; `check` says more)."""
    if cfg.precision != FP8:
        return []
    ds = cfg.deepspeed
    offloaded = (cfg.strategy == "deepspeed" and (ds.offload_optimizer, ds.offload_params) != ("none", "none")
                 or cfg.strategy == "fsdp" and cfg.fsdp.offload_params)
    if offloaded:
        return ["precision=fp8 with offload: the host transfers dominate the step, so fp8's faster matmuls rarely "
                "show; prefer precision=bf16 when offloading"]
    return []


def fp8_backends() -> dict[str, str | None]:
    """Each fp8 backend's version where it imports, None where it is not installed, "broken: ..." where it is found
    but fails to import (a CUDA build on a machine without CUDA, a mismatched torch)."""
    backends: dict[str, str | None] = {}
    for name, module in FP8_BACKEND_MODULES.items():
        if importlib.util.find_spec(module) is None:
            backends[name] = None
            continue
        try:
            backends[name] = str(getattr(importlib.import_module(module), "__version__", "installed"))
        except Exception as error:  # noqa: BLE001 -- a broken install is the finding, not a traceback
            backends[name] = f"broken: {(str(error).splitlines() or [''])[0][:120]}"
    return backends
