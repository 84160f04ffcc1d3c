"""Checks of ZeRO's memory options: CPU/NVMe offload and what a ZeRO-3 run saves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hf_scale.check.findings import ERROR, WARNING, Finding, in_file, is_int
from hf_scale.check.inputs import CheckInputs, deepspeed_view
from hf_scale.files.reading import get_path
from hf_scale.knowledge import rules
from hf_scale.knowledge.library_tables import (
    OFFLOAD_KEEPS_OPTIM,
    OFFLOAD_REPLACEMENT,
    PARSE_ERRORS,
    deepspeed_off_stdout,
)


def check_offload_optimizer(inp: CheckInputs) -> Iterator[Finding]:
    """`offload-optimizer-swap`: optimizer offload without a DeepSpeed `optimizer` block while
    `zero_force_ds_cpu_optimizer` is not false: accelerate swaps the training loop's optimizer for DeepSpeed's CPU
    optimizer of the same algorithm when it has one (torch AdamW, the Trainer's default, runs on as DeepSpeedCPUAdam
    with every parameter group's lr, betas, eps and weight_decay: no finding); any other `--optim` (a warning) is
    replaced by DeepSpeedCPUAdam in Adam mode; raw DeepSpeed raises (an error)."""
    view = deepspeed_view(inp)
    if view is None:
        return
    path = "zero_optimization.offload_optimizer.device"
    device = get_path(view.config, path, "none")
    if device not in ("cpu", "nvme") or "optimizer" in view.config:
        return
    if view.config.get("zero_force_ds_cpu_optimizer", True) is False:
        return
    file, key = view.where(path)
    if inp.runner == "deepspeed":
        problem = (f"The optimizer is offloaded to {device} without an `optimizer` block: deepspeed.initialize "
                   "raises for a client optimizer that is not DeepSpeedCPUAdam.")
    elif inp.runner == "trainer":
        optim = str(getattr((inp.training or {}).get("optim"), "value", (inp.training or {}).get("optim")))
        if inp.training is None or optim in OFFLOAD_KEEPS_OPTIM:
            return  # the same algorithm on the CPU, every hyper-parameter carried over
        problem = (f"The optimizer is offloaded to {device} without an `optimizer` block: --optim {optim} does not "
                   f"run; accelerate replaces it with {OFFLOAD_REPLACEMENT}.")
    else:  # a hand-written Accelerator loop: its optimizer class is not known here
        problem = (f"The optimizer is offloaded to {device} without an `optimizer` block: accelerate keeps torch's "
                   "AdamW, Adam and Adagrad (as DeepSpeed's CPU versions, the parameter groups unchanged) and "
                   f"replaces any other optimizer with {OFFLOAD_REPLACEMENT}.")
    yield Finding(
        ERROR if inp.runner == "deepspeed" else WARNING,
        "offload-optimizer-swap",
        file,
        key,
        problem,
        (
            f"{in_file(file)}set `{key}: none`, or move the DeepSpeed settings into a JSON file "
            '(`deepspeed_config_file`) with an `optimizer` block or `"zero_force_ds_cpu_optimizer": false` '
            "(an inline deepspeed_config cannot set them)"
            if view.from_yaml
            else f'{in_file(file)}add an `optimizer` block, or set `"zero_force_ds_cpu_optimizer": false` '
            f"(`{key}` stays)"
        )
        + ("; or use an --optim accelerate keeps (adamw_torch, adamw_torch_fused, adagrad)." if inp.runner == "trainer"
           else "."),
        {f"{file}:{key}": device},
    )


def check_nvme_path(inp: CheckInputs) -> Iterator[Finding]:
    """`nvme-without-path`: offload to nvme without `nvme_path`."""
    view = deepspeed_view(inp)
    if view is None:
        return
    for what in ("offload_optimizer", "offload_param"):
        device_path = f"zero_optimization.{what}.device"
        nvme = get_path(view.config, f"zero_optimization.{what}.nvme_path", None)
        if get_path(view.config, device_path, None) == "nvme" and nvme in (None, "", "none"):
            file, key = view.where(device_path)
            yield Finding(
                ERROR,
                "nvme-without-path",
                file,
                key,
                f"{what} goes to nvme but no nvme_path is set.",
                f"{in_file(file)}set `"
                + (f"deepspeed_config.{what}_nvme_path" if view.from_yaml else f"zero_optimization.{what}.nvme_path")
                + f"` to a local NVMe mount (or `{key}` to cpu).",
                {f"{file}:{key}": "nvme"},
            )


def check_zero3_save(inp: CheckInputs) -> Iterator[Finding]:
    """`zero3-no-16bit-save`: ZeRO-3 without 16-bit weights gathered on save, in any spelling
    DeepSpeed reads (`stage3_gather_16bit_weights_on_model_save`, `gather_16bit_weights_on_model_save`, the
    deprecated fp16 name; asked from DeepSpeed's own ZeRO model): train.py's final save is the last step's
    checkpoint, not safetensors (hf_scale.train.checkpoint.final_checkpoint)."""
    view = deepspeed_view(inp)
    zero = get_path(view.config, "zero_optimization", None) if view is not None else None
    if not isinstance(zero, dict) or zero.get("stage") != 3 or _gathers_16bit_on_save(zero):
        return
    # Name the spelling the file uses (DeepSpeed reads all of them), else the canonical one.
    spelling = next((name for name in GATHER_SPELLINGS if name in zero), GATHER_SPELLINGS[0])
    value = zero.get(spelling)
    file, key = view.where("zero_optimization." + spelling)
    # "auto" is filled from the YAML's zero3_save_16bit_model, which defaults to false.
    yield Finding(
        WARNING,
        "zero3-no-16bit-save",
        file,
        key,
        f'ZeRO-3 with this at {value!r} (missing and "auto" mean false): no safetensors model is saved at the end; '
        "train.py ends with the final step's DeepSpeed checkpoint (OUTPUT_DIR/checkpoint-STEP) and refuses "
        "--push_to_hub; `hf-scale export` turns the checkpoint into safetensors.",
        f"{in_file(file)}set `{key}` to true to save safetensors at the end (the full 16-bit model gathered on the "
        "main process), or keep it and run `hf-scale export OUTPUT_DIR/checkpoint-STEP OUT` after training.",
        {f"{file}:{key}": value},
    )


GATHER_SPELLINGS = rules.ZERO3_GATHER_SPELLINGS


def _gathers_16bit_on_save(zero: dict[str, Any]) -> bool:
    """What DeepSpeed's own ZeRO model resolves `gather_16bit_weights_on_model_save` to, from any of its
    spellings ("auto" is dropped by DeepSpeed: false); when the section does not parse (reported by the
    schema check), any spelling set to true counts."""
    import pydantic

    with deepspeed_off_stdout():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        try:
            return bool(DeepSpeedZeroConfig(**zero).gather_16bit_weights_on_model_save)
        except (pydantic.ValidationError, *PARSE_ERRORS):
            return any(zero.get(name) is True for name in GATHER_SPELLINGS)


def check_autotuning(inp: CheckInputs) -> Iterator[Finding]:
    """`autotuning-enabled`: `autotuning.enabled: true` in the DeepSpeed config: DeepSpeed's engine profiles a few
    steps and then calls exit() (DeepSpeedEngine._autotuning_exit after `end_profile_step`): the training stops
    partway with exit code 0 and nothing saved. Autotuning is for the `deepspeed --autotuning` launcher only."""
    view = deepspeed_view(inp)
    if view is None or not rules.autotuning_enabled(view.config):
        return
    file, key = view.where("autotuning.enabled")
    with deepspeed_off_stdout():
        from deepspeed.autotuning.constants import AUTOTUNING_END_PROFILE_STEP_DEFAULT

    end = get_path(view.config, "autotuning.end_profile_step", AUTOTUNING_END_PROFILE_STEP_DEFAULT)
    end = end + 1 if is_int(end) else end
    yield Finding(
        ERROR,
        "autotuning-enabled",
        file,
        key,
        f"{rules.AUTOTUNING_EXITS} (at step {end!r}); train.py refuses it.",
        f"{in_file(file)}set `{key}` to false or remove the `autotuning` block (autotuning runs through "
        "`deepspeed --autotuning tune`, not in a training job).",
        {f"{file}:{key}": True},
    )


def check_zero_section(inp: CheckInputs) -> Iterator[Finding]:
    """`zero-section-missing`: a DeepSpeed JSON without `zero_optimization` under the HF Trainer or an Accelerator
    loop: accelerate's DeepSpeedPlugin raises at start ("Please specify the ZeRO optimization config"); raw
    deepspeed.initialize runs it as stage 0."""
    if inp.runner == "deepspeed" or not rules.zero_section_missing(inp.deepspeed):
        return
    file = inp.deepspeed_file or ""
    yield Finding(
        ERROR,
        "zero-section-missing",
        file,
        "zero_optimization",
        f"No `zero_optimization` section: {rules.ZERO_SECTION_REFUSED}; train.py refuses it.",
        f"{in_file(file)}{rules.ZERO_SECTION_FIX}.",
        {f"{file}:zero_optimization": None},
    )
