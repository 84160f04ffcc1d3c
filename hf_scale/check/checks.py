"""Every check of `hf-scale check`, in the order they run and are listed in `hf-scale check --help`.

A check is a function ``CheckInputs -> Iterator[Finding]``; each lives in the module of its family, and the codes it
reports are entries of hf_scale.check.codes.CATALOGUE (which names that module).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from hf_scale.check import (
    accelerate_yaml,
    batch,
    deepspeed_file,
    deepspeed_json,
    fp8,
    moe,
    parallelism,
    precision,
    qlora,
    topology,
    trainer_values,
    zero,
)
from hf_scale.check.findings import Finding
from hf_scale.check.inputs import CheckInputs

Check = Callable[[CheckInputs], Iterator[Finding]]

CHECKS: list[Check] = [
    accelerate_yaml.check_accelerate_top_level,
    accelerate_yaml.check_accelerate_launch,
    accelerate_yaml.check_accelerate_nested_keys,
    accelerate_yaml.check_fsdp2_ignored,
    deepspeed_file.check_deepspeed_file_reference,
    deepspeed_file.check_deepspeed_unused,
    deepspeed_file.check_duplicated_deepspeed_keys,
    batch.check_gradient_accumulation,
    batch.check_micro_batch,
    batch.check_train_batch_size,
    precision.check_precision,
    precision.check_fp16_and_bf16,
    fp8.check_fp8_config,
    fp8.check_fp8_refused,
    fp8.check_fp8_speed,
    qlora.check_qlora,
    deepspeed_json.check_auto_values,
    trainer_values.check_hf_scale_config_flags,
    trainer_values.check_deepspeed_overrides_flags,
    trainer_values.check_trainer_compared_values,
    deepspeed_json.check_deepspeed_changes,
    deepspeed_json.check_deepspeed_schema,
    topology.check_use_cpu_processes,
    topology.check_use_cpu_ignores_plugin,
    topology.check_fsdp_without_gpu,
    topology.check_fsdp_final_save,
    topology.check_processes_per_gpu,
    topology.check_process_count,
    zero.check_offload_optimizer,
    zero.check_nvme_path,
    zero.check_zero3_save,
    zero.check_autotuning,
    zero.check_zero_section,
    topology.check_multinode,
    topology.check_main_process_ip,
    accelerate_yaml.check_accelerate_values,
    parallelism.check_parallelism_block,
    parallelism.check_parallelism_layout,
    parallelism.check_parallelism_model,
    parallelism.check_launched_fsdp,
    moe.check_accelerate_expert_parallel,
    moe.check_deepspeed_expert_parallel,
    deepspeed_json.check_deepspeed_values,
]


def run_checks(inp: CheckInputs) -> list[Finding]:
    """Every check, in order."""
    return [finding for check in CHECKS for finding in check(inp)]
