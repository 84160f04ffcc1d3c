"""What a DistributedConfig (`--hf_scale_config`) decides of train.py's flags, in train.py's own words: the values it
fills (:func:`fill_flags_from_config`, by the table of hf_scale.contract.shared_values, which also names the flags it
fixes), and each rule of a launch against it (the message or None; ``where``: "--hf_scale_config=FILE" or the file
`hf-scale check` reads).

Pure: no launcher, no environment, no process group. train.py's start applies them (hf_scale.train.setup.reconcile),
`hf-scale check` says them from the files (hf_scale.check.trainer_values, hf_scale.check.train_flags), `hf-scale
generate` to a config's cluster.train_args.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Set
from typing import Any

from hf_scale.config import parallelism
from hf_scale.contract.shared_values import CONFIG_FILLS, config_value
from hf_scale.knowledge.rules import compute_precision, precision_from_flags


def filled(ns, fills: Mapping[str, Any]) -> argparse.Namespace:
    """A new namespace: the flags of ``ns`` with ``fills`` in place of theirs (``ns`` stays as it is)."""
    return argparse.Namespace(**{**vars(ns), **fills})


def checkpointing_flag(ns) -> str:
    """The flag that turns activation checkpointing on: transformers 5 renamed --gradient_checkpointing to
    --activation_checkpointing (older transformers have only the old name)."""
    return "activation_checkpointing" if hasattr(ns, "activation_checkpointing") else "gradient_checkpointing"


def checkpointing_spelling(ns) -> dict[str, Any]:
    """The fills that move activation checkpointing to one spelling. transformers 5 keeps
    --gradient_checkpointing as an alias that warns (FutureWarning) whenever it is set; its value moves to the
    new name, so that the one TrainingArguments train.py builds warns about nothing. Idempotent."""
    if checkpointing_flag(ns) == "gradient_checkpointing":
        return {}
    fills: dict[str, Any] = {}
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if getattr(ns, new, None) is None and getattr(ns, old, None) is not None:
            fills[new] = getattr(ns, old)
        if hasattr(ns, old):
            fills[old] = None
    return fills


@dataclasses.dataclass(frozen=True)
class FlagFills:
    """The flag values a DistributedConfig fills, and its contradictions with typed flags (one sentence each; a
    contradicting flag keeps its typed value, every other value is filled)."""

    fills: Mapping[str, Any]
    contradictions: tuple[str, ...]


def launched_layout_mismatch(cfg, launched: parallelism.Layout, cp_comm_strategy: str | None, where: str) -> str | None:
    """Where the accelerate config's parallelism_config (its sizes ``launched``, its ``cp_comm_strategy``) disagrees
    with the config's parallelism, or None. Pure: train.py refuses it at start (apply_hf_scale_config), `hf-scale
    check` says it from the two files (hf_scale.check.trainer_values)."""
    if launched.active and launched.sizes() != cfg.layout.sizes():  # ep is the config's alone (no accelerate key)
        return (f"{where}: parallelism {cfg.layout.describe()} but the accelerate config's parallelism_config has "
                f"{launched.describe()}")
    comm = cfg.parallelism.cp_comm_strategy
    if cfg.layout.cp > 1 and cp_comm_strategy not in (None, comm):
        return (f"{where}: parallelism.cp_comm_strategy={comm} but the accelerate config's parallelism_config has "
                f"cp_comm_strategy {cp_comm_strategy}")
    return None


def fill_flags_from_config(cfg, ns, given: Set[str], where: str) -> FlagFills:
    """The config's batch, clipping, activation checkpointing, optimizer values and precision as flag values
    (``ns``, train.py's parsed flags, only read; ``given``: the flags typed). Pure: no launcher, no environment,
    so that `hf-scale check` applies the same rule."""
    batch = cfg.batch
    fills = checkpointing_spelling(ns)
    ns = filled(ns, fills)  # a view with one spelling of activation checkpointing
    contradictions: list[str] = []
    for flag, field, unset in CONFIG_FILLS:
        value = config_value(cfg, field, unset)
        contradictions += _fill_or_match(ns, given, where, flag, field, value, fills)
    if "deepspeed" in given and ns.deepspeed and cfg.strategy != "deepspeed":
        contradictions.append(f"{where}: strategy={cfg.strategy} but --deepspeed={ns.deepspeed} asks for DeepSpeed; "
                              "drop --deepspeed, or set strategy: deepspeed (the config then writes the DeepSpeed "
                              "JSON)")
    if ns.auto_find_batch_size:
        contradictions.append(f"{where}: --auto_find_batch_size would change batch.micro_batch_size="
                              f"{batch.micro_batch_size} (global batch {batch.global_batch_size}) at run time; drop it")
    optim = str(getattr(ns.optim, "value", ns.optim))
    if "optim" in given and "adam" not in optim:
        contradictions.append(f"{where}: optimizer.betas and optimizer.eps are AdamW's, but --optim={optim} does not "
                              "use them; use an AdamW --optim (adamw_torch, adamw_torch_fused, adamw_8bit, ...) or "
                              "leave it out")
    # activation_checkpointing -> the Trainer's flag (the model's own checkpointing, in both loops); either
    # spelling counts as typed.
    flag = checkpointing_flag(ns)
    typed = bool(given & {"gradient_checkpointing", "activation_checkpointing"})
    if cfg.strategy == "fsdp" and cfg.fsdp.activation_checkpointing and typed and getattr(ns, flag):
        contradictions.append(f"{where}: fsdp.activation_checkpointing=true checkpoints the decoder layers already; "
                              "drop --gradient_checkpointing / --activation_checkpointing (the layers would be "
                              "checkpointed twice)")
    elif typed and bool(getattr(ns, flag)) != cfg.activation_checkpointing:
        spelling = "gradient_checkpointing" if "gradient_checkpointing" in given else flag
        contradictions.append(f"{where}: activation_checkpointing={_show(cfg.activation_checkpointing)} but "
                              f"--{spelling}={_show(bool(getattr(ns, flag)))}")
    else:
        fills[flag] = cfg.activation_checkpointing
    flags_precision = precision_from_flags(ns.bf16, ns.fp16)
    computes_in = compute_precision(cfg.precision)  # fp8 runs with --bf16 (bf16 outside the fp8 matmuls)
    if given & {"bf16", "fp16"} and flags_precision != computes_in:
        contradictions.append(f"{where}: precision={cfg.precision} but the flags ask for {flags_precision}")
    else:
        fills.update(bf16=computes_in == "bf16", fp16=computes_in == "fp16")
    return FlagFills(fills, tuple(contradictions))


# The rules of the launch against the config, each pure (the message or None; ``where``: "--hf_scale_config=FILE"):
# train.py refuses on them at start (hf_scale.train.setup.reconcile), `hf-scale check` says them from the files
# (hf_scale.check.trainer_values).

def world_size_mismatch(cfg, launcher: str, world_size: int, where: str) -> str | None:
    if cfg.world_size == world_size:
        return None
    return (f"{where}: world_size={cfg.world_size} ({cfg.topology.num_machines} machines x "
            f"{cfg.topology.processes_per_machine} processes_per_machine) but the {launcher} launcher started "
            f"WORLD_SIZE={world_size}")


def engine_mismatch(cfg, launcher: str, launched_strategy: str, where: str) -> str | None:
    """An engine the launcher chose (DeepSpeed, FSDP) that is not the config's strategy."""
    if launched_strategy in ("deepspeed", "fsdp") and launched_strategy != cfg.strategy:
        return f"{where}: strategy={cfg.strategy} but the {launcher} launch configures {launched_strategy}"
    return None


def zero_stage_mismatch(cfg, zero_stage: int | None, source: str, where: str) -> str | None:
    """``source``: the launcher's DeepSpeed JSON, or the accelerate config's inline deepspeed_config."""
    if zero_stage == cfg.deepspeed.zero_stage:
        return None
    return (f"{where}: deepspeed.zero_stage={cfg.deepspeed.zero_stage} but {source} has "
            f"zero_optimization.stage={zero_stage}")


def precision_mismatch(cfg, mixed_precision: str | None, where: str) -> str | None:
    """The accelerate config's mixed_precision (None: not launched by accelerate) against the config's precision."""
    if mixed_precision in (None, cfg.precision):
        return None
    return f"{where}: precision={cfg.precision} but the accelerate config has mixed_precision={mixed_precision}"


def fsdp_checkpointing_mismatch(cfg, launched: str | None, where: str) -> str | None:
    """accelerate's FSDP plugin applies fsdp.activation_checkpointing: the FSDP_ACTIVATION_CHECKPOINTING accelerate
    launch exports from the YAML (None: left out) must say the same."""
    yaml_value = str(launched or "false").lower() == "true"
    if yaml_value == cfg.fsdp.activation_checkpointing:
        return None
    return (f"{where}: fsdp.activation_checkpointing={_show(cfg.fsdp.activation_checkpointing)} but the accelerate "
            f"config has fsdp_activation_checkpointing={_show(yaml_value)}")


def _fill_or_match(ns, given: Set[str], where: str, flag: str, field: str, value, fills: dict) -> list[str]:
    if flag in given and getattr(ns, flag) != value:
        return [f"{where}: {field}={_show(value)} but --{flag}={_show(getattr(ns, flag))}"]
    fills[flag] = value
    return []


def _show(value) -> str:
    """As the config and the flags write it (true/false, not True/False)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
