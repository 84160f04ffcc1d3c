"""The values a run's config, train.py's flags, the accelerate YAML and the DeepSpeed JSON share: ONE table
(:data:`SHARED_VALUES`, one row per value), from which every other view is derived: the DeepSpeed keys the Trainer
compares with a flag (:data:`FLAG_KEYS`), the flags a DistributedConfig fills (:data:`CONFIG_FILLS`) and fixes
(:data:`FIXED_BY_HF_SCALE_CONFIG`), accelerate's YAML -> DeepSpeed map (:data:`ACCELERATE_YAML_TO_DEEPSPEED`) and the
DeepSpeed keys the Trainer fills when they say "auto" (:data:`TRAINER_FILLED`, :data:`TRAINER_FILLED_ZERO3_ONLY`).

A train.py flag is the TrainingArguments field of the same name (train.py parses TrainingArguments), so the flag
column is also the Trainer's field. tests/contract/test_shared_values.py holds the table to the libraries: every flag
is a train.py flag, every DeepSpeed key is in DeepSpeed's own config schema, every config field is a
DistributedConfig's; tests/knowledge/test_library_tables.py proves the YAML map and the Trainer's fills against
accelerate's and transformers' source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ALWAYS, ZERO3_ONLY = "always", "zero-3 only"
"""When the Trainer fills a DeepSpeed key left "auto" (transformers' HfTrainerDeepSpeedConfig.trainer_config_process
and trainer_config_finalize; the ZeRO-3 bucket sizes only under stage 3)."""


@dataclass(frozen=True)
class SharedValue:
    """One value, as each place spells it (None or empty: that place does not hold it)."""

    deepspeed_key: str
    """The DeepSpeed JSON path, e.g. ``optimizer.params.lr``."""
    flags: tuple[str, ...] = ()
    """train.py's flag(s) (TrainingArguments fields) holding it; two for the Adam betas."""
    config_fields: tuple[str, ...] = ()
    """The DistributedConfig fields that fill ``flags`` one to one (same order); empty where the config fills the
    flag by another rule (precision: hf_scale.contract.config_flags) or not at all."""
    config_unset: Any = None
    """The flag's value when the config field is null (no gradient clipping: --max_grad_norm 0)."""
    yaml_key: str | None = None
    """The accelerate YAML's ``deepspeed_config`` key that sets it (DeepSpeedPlugin's plugin_to_config_mapping)."""
    trainer_fills: str | None = None
    """ALWAYS / ZERO3_ONLY: the Trainer fills the key when the JSON says "auto"; None: it does not."""
    fill_match: bool = False
    """The Trainer compares the JSON's value with ``flags`` one to one (``fill_match``; rows in transformers'
    order): hf_scale.contract.launch_values applies the same comparison first."""
    fixed_by_config: bool = False
    """An ``--hf_scale_config`` fixes ``flags``: the launcher's config must agree with them."""


SHARED_VALUES: tuple[SharedValue, ...] = (
    SharedValue("train_micro_batch_size_per_gpu", ("per_device_train_batch_size",), ("batch.micro_batch_size",),
                trainer_fills=ALWAYS, fill_match=True, fixed_by_config=True),
    SharedValue("gradient_accumulation_steps", ("gradient_accumulation_steps",),
                ("batch.gradient_accumulation_steps",), yaml_key="gradient_accumulation_steps", trainer_fills=ALWAYS,
                fill_match=True, fixed_by_config=True),
    SharedValue("gradient_clipping", ("max_grad_norm",), ("gradient_clipping",), config_unset=0.0,
                yaml_key="gradient_clipping", trainer_fills=ALWAYS, fill_match=True, fixed_by_config=True),
    SharedValue("optimizer.params.lr", ("learning_rate",), ("optimizer.lr",), trainer_fills=ALWAYS, fill_match=True,
                fixed_by_config=True),
    SharedValue("optimizer.params.betas", ("adam_beta1", "adam_beta2"), ("optimizer.betas[0]", "optimizer.betas[1]"),
                trainer_fills=ALWAYS, fill_match=True, fixed_by_config=True),
    SharedValue("optimizer.params.eps", ("adam_epsilon",), ("optimizer.eps",), trainer_fills=ALWAYS, fill_match=True,
                fixed_by_config=True),
    SharedValue("optimizer.params.weight_decay", ("weight_decay",), ("optimizer.weight_decay",), trainer_fills=ALWAYS,
                fill_match=True, fixed_by_config=True),
    SharedValue("scheduler.params.warmup_max_lr", ("learning_rate",), trainer_fills=ALWAYS, fill_match=True),
    SharedValue("bf16.enabled", ("bf16",), trainer_fills=ALWAYS, fixed_by_config=True),
    SharedValue("fp16.enabled", ("fp16",), trainer_fills=ALWAYS, fixed_by_config=True),
    SharedValue("train_batch_size", trainer_fills=ALWAYS),
    SharedValue("scheduler.params.warmup_min_lr", trainer_fills=ALWAYS),
    SharedValue("scheduler.params.total_num_steps", trainer_fills=ALWAYS),
    SharedValue("scheduler.params.warmup_num_steps", trainer_fills=ALWAYS),
    SharedValue("zero_optimization.reduce_bucket_size", trainer_fills=ALWAYS),
    SharedValue("zero_optimization.stage3_prefetch_bucket_size", trainer_fills=ZERO3_ONLY),
    SharedValue("zero_optimization.stage3_param_persistence_threshold", trainer_fills=ZERO3_ONLY),
    SharedValue("zero_optimization.stage", yaml_key="zero_stage"),
    SharedValue("zero_optimization.offload_optimizer.device", yaml_key="offload_optimizer_device"),
    SharedValue("zero_optimization.offload_param.device", yaml_key="offload_param_device"),
    SharedValue("zero_optimization.offload_param.nvme_path", yaml_key="offload_param_nvme_path"),
    SharedValue("zero_optimization.offload_optimizer.nvme_path", yaml_key="offload_optimizer_nvme_path"),
    SharedValue("zero_optimization.stage3_gather_16bit_weights_on_model_save", yaml_key="zero3_save_16bit_model"),
)

FLAG_KEYS: tuple[tuple[str, str | tuple[str, ...]], ...] = tuple(
    (row.deepspeed_key, row.flags[0] if len(row.flags) == 1 else row.flags) for row in SHARED_VALUES if row.fill_match)
"""(DeepSpeed key, flag or flags) pairs the Trainer fill_match-es one to one, in transformers' order."""
CONFIG_FILLS: tuple[tuple[str, str, Any], ...] = tuple(
    (flag, field, row.config_unset) for row in SHARED_VALUES if row.config_fields
    for flag, field in zip(row.flags, row.config_fields, strict=True))
"""(flag, DistributedConfig field, the flag's value when the field is null): what the config fills one to one."""
FIXED_BY_HF_SCALE_CONFIG: tuple[str, ...] = tuple(dict.fromkeys(
    flag for row in SHARED_VALUES if row.fixed_by_config for flag in row.flags))
"""The flags an --hf_scale_config fixes (and activation checkpointing, under the name
config_flags.checkpointing_flag gives)."""
ACCELERATE_YAML_TO_DEEPSPEED: dict[str, str] = {row.yaml_key: row.deepspeed_key for row in SHARED_VALUES
                                                if row.yaml_key}
"""accelerate's DeepSpeedPlugin.__post_init__ (`plugin_to_config_mapping`, accelerate/utils/dataclasses.py): the YAML's
`deepspeed_config` keys and the DeepSpeed JSON paths they set."""
TRAINER_FILLED: frozenset[str] = frozenset(row.deepspeed_key for row in SHARED_VALUES
                                           if row.trainer_fills == ALWAYS or row.yaml_key)
"""DeepSpeed keys the Trainer path fills when "auto": transformers' own fills and accelerate's plugin's (the YAML map),
which runs under the Trainer too."""
TRAINER_FILLED_ZERO3_ONLY: frozenset[str] = frozenset(row.deepspeed_key for row in SHARED_VALUES
                                                      if row.trainer_fills == ZERO3_ONLY)

_PART = re.compile(r"(\w+)(?:\[(\d+)\])?$")


def config_value(cfg, field: str, unset: Any = None) -> Any:
    """The value of a dotted DistributedConfig field (``optimizer.betas[0]``) of ``cfg``; with ``unset``, that when
    the field is null or zero (as the flag spells "none")."""
    node = cfg
    for part in field.split("."):
        name, index = _PART.match(part).groups()
        node = getattr(node, name)
        if index is not None:
            node = node[int(index)]
    return node if unset is None else (node or unset)
