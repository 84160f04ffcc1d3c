"""What the launcher asked for, and the process group that makes it real.

train.py is started by `python`, `torchrun`, `accelerate launch` or `deepspeed`. Each launcher says
what it wants in a different place (environment variables, `--deepspeed`, an accelerate YAML turned
into `ACCELERATE_*` variables). :func:`detect_launch` reads all of them into one
:class:`LaunchRequest`; :func:`init_process_state` then creates accelerate's `PartialState` so that
the requested engine really runs — on a machine without GPUs that needs the gloo backend, which
accelerate does not pick by itself (without it each of N processes silently trains alone, which
`guard.py` would then stop).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch

from hf_scale import parallelism
from hf_scale.errors import UserError
from hf_scale.train.setup.inline_deepspeed import InlineDeepSpeed, is_inline, plugin_for

Strategy = Literal["single", "ddp", "deepspeed", "fsdp"]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes"}


def has_gpu() -> bool:
    return torch.cuda.is_available()


@dataclass(frozen=True)
class LaunchRequest:
    """The strategy and sizes the launcher (and the flags) ask for, before anything is initialised."""

    launcher: str
    """Which launcher started this process, for messages: python | torchrun | accelerate | deepspeed."""
    world_size: int
    """`WORLD_SIZE` set by the launcher (1 when started with plain `python`)."""
    strategy: Strategy
    deepspeed_config_file: str | None
    """DeepSpeed JSON from `--deepspeed` or from the accelerate YAML's `deepspeed_config_file`."""
    zero_stage: int | None
    """`zero_optimization.stage` of that JSON (0 when the JSON has no zero section)."""
    mixed_precision: str | None
    """accelerate's `mixed_precision` from the YAML (`ACCELERATE_MIXED_PRECISION`), None if not launched by it."""
    fsdp_settings: dict | None = None
    """The `fsdp` section of a `--hf_scale_config` when it (not accelerate's YAML) asks for FSDP."""
    deepspeed_inline: InlineDeepSpeed | None = None
    """DeepSpeed from an accelerate YAML's inline `deepspeed_config` (no JSON file): see inline_deepspeed."""
    fp8_backend: str | None = None
    """FP8 training's backend (torchao | te | msamp: the config's fp8.backend) when the YAML's mixed_precision or
    the --hf_scale_config asks for fp8; None otherwise."""


def _read_deepspeed_json(path: str, flag: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{flag}={path}: file not found (expected a DeepSpeed JSON config)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{flag}={path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(config, dict):
        raise UserError(
            f"{flag}={path}: a DeepSpeed config must be a JSON object, got {type(config).__name__}"
        )
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"{flag}={path}: zero_optimization.stage={stage!r} is not allowed; use 0, 1, 2 or 3")
    return config


def deepspeed_config_dict(value: str | dict | None) -> dict | None:
    """The DeepSpeed config that will run, as `--deepspeed` holds it by now: a JSON path, or the dict built
    from an inline accelerate YAML or from --hf_scale_config."""
    if value is None or isinstance(value, dict):
        return value
    return _read_deepspeed_json(value, "--deepspeed")


def detect_launch(deepspeed_flag: str | None) -> LaunchRequest:
    """Read the launcher's request from the environment and `--deepspeed`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    by_accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
    refusal = parallelism.train_refusal(parallelism.launch_layout(dict(os.environ)), "the accelerate config's "
                                        "parallelism_config")
    if refusal:
        raise UserError(refusal)
    if by_accelerate:
        launcher = "accelerate"
    elif "CROSS_RANK" in os.environ:  # set by deepspeed/launcher/launch.py only
        launcher = "deepspeed"
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = "torchrun"
    else:
        launcher = "python"

    accelerate_ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if by_accelerate else None
    if deepspeed_flag and is_inline(os.environ):
        # accelerate's DeepSpeedPlugin refuses a config next to the YAML's DeepSpeed keys (ValueError later).
        raise UserError(
            f"--deepspeed={deepspeed_flag} while the accelerate config sets DeepSpeed inline (deepspeed_config: "
            f"{os.environ.get('ACCELERATE_CONFIG_DS_FIELDS', '')}); use one of them"
        )
    if (
        deepspeed_flag
        and accelerate_ds_file
        and Path(deepspeed_flag).resolve() != Path(accelerate_ds_file).resolve()
    ):
        raise UserError(
            f"--deepspeed={deepspeed_flag} conflicts with the accelerate config's deepspeed_config_file="
            f"{accelerate_ds_file}; pass only one of them"
        )
    ds_file = deepspeed_flag or accelerate_ds_file
    use_deepspeed = bool(ds_file) or (by_accelerate and _env_true("ACCELERATE_USE_DEEPSPEED"))
    inline = None
    zero_stage = None
    if ds_file:
        flag = "--deepspeed" if deepspeed_flag else "deepspeed_config_file"
        zero_stage = _read_deepspeed_json(ds_file, flag).get("zero_optimization", {}).get("stage", 0)
    elif use_deepspeed and is_inline(os.environ):
        # The YAML's settings sit inline under deepspeed_config: accelerate's DeepSpeedPlugin reads them.
        inline = plugin_for(os.environ)
        zero_stage = inline.zero_stage

    if use_deepspeed:
        strategy: Strategy = "deepspeed"
    elif by_accelerate and _env_true("ACCELERATE_USE_FSDP"):
        strategy = "fsdp"
    elif world_size > 1:
        strategy = "ddp"
    else:
        strategy = "single"
    return LaunchRequest(
        launcher=launcher,
        world_size=world_size,
        strategy=strategy,
        deepspeed_config_file=ds_file,
        zero_stage=zero_stage,
        mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION") if by_accelerate else None,
        deepspeed_inline=inline,
        fp8_backend=_fp8_backend_from_env() if by_accelerate else None,
    )


def _fp8_backend_from_env() -> str | None:
    """The backend `accelerate launch` exports for a YAML with mixed_precision fp8 (its fp8_config.backend); without
    one accelerate picks torchao first, as here."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION") != "fp8":
        return None
    from hf_scale.train.model.fp8 import BACKEND_OF_ACCELERATE

    return BACKEND_OF_ACCELERATE.get(os.environ.get("ACCELERATE_FP8_BACKEND", "").upper(), "torchao")


def init_process_state(request: LaunchRequest, *, ddp_timeout_s: int, ddp_backend: str | None):
    """Create accelerate's `PartialState` for the request, before `TrainingArguments` exists.

    `TrainingArguments(accelerator_config={"use_configured_state": True})` then reuses it, and so does the
    manual loop's `Accelerator`. Without a GPU: DeepSpeed runs over gloo (accelerate would otherwise
    pick no backend and report `DistributedType.NO` in every process) and DDP runs as accelerate's
    MULTI_CPU (`cpu=True`), which wraps the model in real DDP over gloo.
    """
    from accelerate import PartialState

    if request.strategy == "deepspeed":
        # What TrainingArguments does for `--deepspeed` too: accelerate decides DEEPSPEED from this variable.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        if "MASTER_ADDR" not in os.environ:
            # `python train.py --deepspeed …`: DeepSpeed needs a process group even for one process; give it
            # the single-process rendezvous a launcher would have set (what the HF docs do in notebooks).
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
    kwargs: dict = {"timeout": timedelta(seconds=ddp_timeout_s)}
    if not has_gpu():
        # FSDP from --hf_scale_config is sharded by torch's fully_shard on CPU (train/fsdp.py); accelerate
        # then only needs its MULTI_CPU state. FSDP from an accelerate YAML stays as asked, and the
        # runtime guard reports that accelerate cannot shard on CPU.
        if request.strategy in ("ddp", "single") or request.fsdp_settings is not None:
            kwargs["cpu"] = True
        if request.world_size > 1 or request.strategy == "deepspeed":
            kwargs["backend"] = "gloo"
    elif ddp_backend:
        kwargs["backend"] = ddp_backend
    return PartialState(**kwargs)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shutdown(*, barrier: bool = True) -> None:
    """End the process group cleanly.

    A gloo/DeepSpeed run that exits with the group alive aborts at interpreter exit (SIGABRT) although
    training finished, and the launcher reports failure.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
