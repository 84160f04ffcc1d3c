"""FP8 and 4-bit rules that need the config but no library: the config's refusals and warnings, and what the
generated accelerate YAML says about fp8, and which fp8 backends import here (`doctor`). Torch-free, like
hf_scale.rules (which holds the tables); the decisions that need torch (which modules become fp8, the GPU) are
hf_scale.train.model.fp8's.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from hf_scale.rules import FP8, FP8_BACKEND_MODULES, FP8_BACKENDS

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


def fp8_config_problem(cfg: Any) -> str | None:
    """Why a config with precision fp8 cannot run as written (None when it can): combinations accelerate refuses
    at start, said before any file is generated."""
    backend, strategy = cfg.fp8.backend, cfg.strategy
    if backend == "torchao" and strategy == "fsdp" and cfg.fsdp.cpu_ram_efficient_loading:
        # accelerate.Accelerator.__init__: "torchao with FSDP2 and cpu_ram_efficient_loading is not supported".
        return ("precision=fp8 with fp8.backend=torchao and strategy=fsdp needs fsdp.cpu_ram_efficient_loading=false "
                "(accelerate refuses torchao's float8 layers with rank-0-only loading)")
    if backend == "msamp" and strategy in ("fsdp", "deepspeed"):
        # accelerate: MS-AMP + FSDP is NotImplementedError; under DeepSpeed it needs DeepSpeed's own msamp block,
        # which accelerate adds only when the launcher exports the backend (never with a DeepSpeed config file).
        return (f"fp8.backend=msamp with strategy={strategy} is not supported (allowed: strategy single or ddp); use "
                "fp8.backend=torchao or te")
    return None


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
