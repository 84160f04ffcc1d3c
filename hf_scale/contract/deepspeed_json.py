"""DeepSpeed JSON from a DistributedConfig.

Two modes:

* ``auto``: ``"auto"`` exactly where the HF Trainer fills the value from its own arguments
  (``HfTrainerDeepSpeedConfig.trainer_config_process``/``trainer_config_finalize`` in
  transformers/integrations/deepspeed.py): the batch triple, gradient clipping, the optimizer's
  lr/betas/eps/weight_decay and the hidden-size based ZeRO buckets when the config says "auto". The
  flags are then the single source of truth for those numbers.
* ``resolved``: concrete numbers everywhere, for a manual Accelerator loop or the ``deepspeed``
  launcher with ``deepspeed.initialize``, where nobody resolves "auto".

Precision blocks are concrete in both modes: with ``"enabled": "auto"`` the Trainer silently follows
whatever ``--bf16/--fp16`` says; a concrete value makes it raise on a mismatch instead.

An ``optimizer`` block is written only where DeepSpeed must build the optimizer itself (see
:func:`needs_optimizer_block`): with optimizer offload (DeepSpeedCPUAdam, a C++ op), or when the config
asks for it (``deepspeed.fused_adam``: DeepSpeed's CUDA FusedAdam; ``deepspeed.torch_adam``: torch's AdamW
created by DeepSpeed). Otherwise the training loop's torch optimizer runs (the Trainer's ``--optim``,
fused AdamW on GPU) and no DeepSpeed op is compiled at run time: no nvcc, no C++ compiler, and a
``TORCH_CUDA_ARCH_LIST`` DeepSpeed cannot parse (``9.0a``) does not matter. There is never a
``scheduler`` block: DeepSpeed's scheduler would silently override ``--lr_scheduler_type``; the training
loop's torch scheduler is used instead.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.knowledge.rules import compute_precision

Mode = Literal["auto", "resolved"]
MODES: tuple[Mode, ...] = ("auto", "resolved")

# DeepSpeed's own defaults (deepspeed/runtime/zero/config.py) for the knobs whose "auto" needs the
# model's hidden size; the resolved mode cannot see the model, so it writes what DeepSpeed would use.
DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000
DEEPSPEED_DEFAULT_STAGE3_PREFETCH_BUCKET_SIZE = 50_000_000
DEEPSPEED_DEFAULT_STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000
# DeepSpeed logs every `steps_per_print` steps on its own; the Trainer / training loop does the logging.
STEPS_PER_PRINT = 1_000_000_000


def deepspeed_config(cfg: DistributedConfig, mode: Mode) -> dict[str, Any]:
    """The DeepSpeed config dict (insertion order is the file's key order)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    auto = mode == "auto"
    batch = cfg.batch

    def pick(resolved: Any) -> Any:
        return "auto" if auto else resolved

    config: dict[str, Any] = {
        "train_batch_size": pick(batch.global_batch_size),
        "train_micro_batch_size_per_gpu": pick(batch.micro_batch_size),
        "gradient_accumulation_steps": pick(batch.gradient_accumulation_steps),
        # 0.0 switches clipping off explicitly: an absent key means DeepSpeed's default of 1.0.
        "gradient_clipping": pick(cfg.gradient_clipping or 0.0),
        # fp8 runs on DeepSpeed's bf16 (accelerate's DeepSpeedPlugin.set_mixed_precision does the same).
        "bf16": {"enabled": compute_precision(cfg.precision) == "bf16"},
        "fp16": _fp16_block(cfg.precision == "fp16"),
    }
    if needs_optimizer_block(cfg):
        config["optimizer"] = _optimizer_block(cfg, pick)
    config["zero_optimization"] = _zero_block(cfg, auto)
    if cfg.activation_checkpointing:
        # Only consulted by models that use deepspeed.checkpointing; HF models checkpoint with torch
        # (gradient_checkpointing_enable), so the block is kept conservative: no partitioning/offload.
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
        }
    config["steps_per_print"] = STEPS_PER_PRINT
    config["wall_clock_breakdown"] = False
    return config


def deepspeed_json(cfg: DistributedConfig, mode: Mode) -> str:
    """The DeepSpeed config as JSON text: indent 2, trailing newline, stable key order."""
    return json.dumps(deepspeed_config(cfg, mode), indent=2) + "\n"


def _fp16_block(enabled: bool) -> dict[str, Any]:
    if not enabled:
        return {"enabled": False}
    # Dynamic loss scaling (loss_scale 0) with DeepSpeed's documented starting point, written out so the
    # file shows what runs.
    return {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }


def needs_optimizer_block(cfg: DistributedConfig) -> bool:
    """DeepSpeed builds the optimizer from the JSON only for optimizer offload (its CPU Adam works on the
    offloaded fp32 states) or when the config asks for DeepSpeed's Adam (fused_adam / torch_adam)."""
    ds = cfg.deepspeed
    offloaded = ds.zero_stage > 0 and ds.offload_optimizer != "none"
    return offloaded or ds.fused_adam or ds.torch_adam


def _optimizer_block(cfg: DistributedConfig, pick) -> dict[str, Any]:
    opt = cfg.optimizer
    params: dict[str, Any] = {
        "lr": pick(opt.lr),
        "betas": pick(list(opt.betas)),
        "eps": pick(opt.eps),
        "weight_decay": pick(opt.weight_decay),
    }
    if cfg.deepspeed.torch_adam:
        params["torch_adam"] = True
    return {"type": "AdamW", "params": params}


def _offload_block(device: str, cfg: DistributedConfig) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device}
    if device == "nvme":
        block["nvme_path"] = cfg.deepspeed.nvme_path
    block["pin_memory"] = cfg.deepspeed.pin_memory
    return block


def _zero_block(cfg: DistributedConfig, auto: bool) -> dict[str, Any]:
    ds = cfg.deepspeed

    def bucket(value: int | str, deepspeed_default: int) -> int | str:
        if value == "auto" and not auto:
            return deepspeed_default
        return value

    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage == 0:
        return zero
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_block(ds.offload_optimizer, cfg)
    if ds.zero_stage == 3 and ds.offload_params != "none":
        zero["offload_param"] = _offload_block(ds.offload_params, cfg)
    zero["overlap_comm"] = ds.overlap_comm
    zero["contiguous_gradients"] = ds.contiguous_gradients
    zero["reduce_bucket_size"] = bucket(ds.reduce_bucket_size, DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE)
    if ds.zero_stage < 3:
        zero["allgather_partitions"] = True
        zero["allgather_bucket_size"] = ds.allgather_bucket_size
        zero["reduce_scatter"] = True
        return zero
    zero["stage3_prefetch_bucket_size"] = bucket(
        ds.stage3_prefetch_bucket_size, DEEPSPEED_DEFAULT_STAGE3_PREFETCH_BUCKET_SIZE
    )
    zero["stage3_param_persistence_threshold"] = bucket(
        ds.stage3_param_persistence_threshold, DEEPSPEED_DEFAULT_STAGE3_PARAM_PERSISTENCE_THRESHOLD
    )
    zero["stage3_max_live_parameters"] = ds.stage3_max_live_parameters
    zero["stage3_max_reuse_distance"] = ds.stage3_max_reuse_distance
    zero["sub_group_size"] = ds.sub_group_size
    zero["stage3_gather_16bit_weights_on_model_save"] = ds.gather_16bit_weights_on_save
    return zero
