"""Mixture-of-experts checks of the files users bring: DeepSpeed's own expert parallelism (the JSON's
``expert_parallel`` section, AutoEP in DeepSpeed >= 0.19), an expert-parallel size that does not divide the model's
experts or the world, and the expert-parallel size accelerate's ``parallelism_config:`` has no key for.

The sizes are judged by the rules DeepSpeed applies inside ``deepspeed.initialize`` (module_inject/auto_ep_config.py:
``validate_autoep_config`` and ``build_folding_spec``: autoep_size x expert_tensor_parallel_size divides the world
size, expert_tensor_parallel_size is 1; ``num_experts % autoep_size``), one traceback per rank there, one finding here.
"""

from __future__ import annotations

from collections.abc import Iterator

from hf_scale.check.findings import ERROR, WARNING, Finding, in_file, is_int
from hf_scale.check.inputs import CheckInputs, local_model_config, world_size_of
from hf_scale.config import expert_parallel, parallelism

SECTION = "expert_parallel"
"""DeepSpeed's AutoEP section (deepspeed/runtime/config.py EXPERT_PARALLEL)."""
ACCELERATE_EP_KEY = f"{parallelism.YAML_PREFIX}ep_size"


def check_deepspeed_expert_parallel(inp: CheckInputs) -> Iterator[Finding]:
    """`moe-deepspeed-autoep`, `moe-ep-size`, `moe-ep-ignored`: a DeepSpeed JSON whose
    `expert_parallel` section turns on DeepSpeed's AutoEP (it replaces the model's MoE layers inside
    deepspeed.initialize: not what hf_scale's parallelism.ep runs, nor proven with train.py); an `autoep_size` that does
    not divide the world size or the model's routed experts, or an `expert_tensor_parallel_size` other than 1
    (DeepSpeed raises on each when the processes start); sizes set in a section that is not enabled."""
    section = (inp.deepspeed or {}).get(SECTION)
    if not isinstance(section, dict) or inp.deepspeed_file is None:
        return
    file = inp.deepspeed_file
    size = section.get("autoep_size", 1)
    if section.get("enabled") is not True:
        if is_int(size) and size > 1:
            yield Finding(WARNING, "moe-ep-ignored", file, f"{SECTION}.autoep_size",
                          f"autoep_size={size} without `{SECTION}.enabled: true`: DeepSpeed ignores every setting of "
                          "the section and runs no expert parallelism.",
                          f"{in_file(file)}set `{SECTION}.enabled: true` for the autoep_size to apply, or remove "
                          "the section.",
                          {f"{file}:{SECTION}.enabled": section.get("enabled"), f"{file}:{SECTION}.autoep_size": size})
        return
    yield Finding(WARNING, "moe-deepspeed-autoep", file, f"{SECTION}.enabled",
                  "DeepSpeed's AutoEP replaces the model's MoE layers with its own inside deepspeed.initialize; "
                  f"hf_scale's train.py has not proven it (its expert parallelism is {expert_parallel.__name__}: "
                  "parallelism.ep with strategy fsdp, transformers' own EP plan).",
                  f"{in_file(file)}keep it if your own script runs it; with train.py set `{SECTION}.enabled: false` "
                  "and use an hf_scale config with strategy fsdp and parallelism.ep.",
                  {f"{file}:{SECTION}.enabled": True})
    yield from _size_findings(inp, section, file)


def _size_findings(inp: CheckInputs, section: dict, file: str) -> Iterator[Finding]:
    size, etp = section.get("autoep_size", 1), section.get("expert_tensor_parallel_size", 1)
    key = f"{SECTION}.autoep_size"
    if not (is_int(size) and size >= 1):
        yield Finding(ERROR, "moe-ep-size", file, key, f"autoep_size={size!r} is not a positive integer: DeepSpeed "
                      "refuses it.", f"{in_file(file)}set `{key}` to a divisor of the model's experts.",
                      {f"{file}:{key}": size})
        return
    if etp != 1:
        yield Finding(ERROR, "moe-ep-size", file, f"{SECTION}.expert_tensor_parallel_size",
                      f"expert_tensor_parallel_size={etp!r}: DeepSpeed's AutoEP accepts only 1 (it raises "
                      "\"reserved for expert tensor parallelism\").",
                      f"{in_file(file)}set `{SECTION}.expert_tensor_parallel_size` to 1 (or remove it).",
                      {f"{file}:{SECTION}.expert_tensor_parallel_size": etp})
    world = world_size_of(inp)
    if world is not None and world % size:
        yield Finding(ERROR, "moe-ep-size", file, key,
                      f"autoep_size={size} does not divide the world size {world}: DeepSpeed's folding needs whole "
                      "expert-parallel groups (\"Computed edp would be non-integral\").",
                      f"{in_file(file)}set `{key}` to a divisor of {world}: "
                      f"{', '.join(str(d) for d in range(1, world + 1) if world % d == 0)}.",
                      {f"{file}:{key}": size,
                       **({f"{inp.accelerate_file}:num_processes": world} if inp.accelerate_file else {})})
    config = local_model_config(inp)
    routed = expert_parallel.expert_counts(config)[0] if config is not None else None
    if config is not None and routed is None:
        yield Finding(ERROR, "moe-ep-size", file, f"{SECTION}.enabled",
                      f"the model ({getattr(config, 'model_type', '?')}) is dense: AutoEP finds no MoE layer to "
                      "replace.", f"{in_file(file)}set `{SECTION}.enabled: false` (or remove the section) for a dense "
                      "model.",
                      {f"{file}:{SECTION}.enabled": True})
    elif routed is not None and routed % size:
        divisors = ", ".join(str(d) for d in range(1, routed + 1) if routed % d == 0)
        yield Finding(ERROR, "moe-ep-size", file, key,
                      f"autoep_size={size} does not divide the model's {routed} routed experts: each rank must hold "
                      "whole experts (DeepSpeed raises when it replaces the layers).",
                      f"{in_file(file)}set `{key}` to one of {divisors}.",
                      {f"{file}:{key}": size, f"{inp.training.get('model_name_or_path')}:experts": routed})


def check_accelerate_expert_parallel(inp: CheckInputs) -> Iterator[Finding]:
    """`moe-accelerate-ep`: an expert-parallel size in the accelerate YAML's `parallelism_config:` block,
    which accelerate has no option for (its ep_size pull request, huggingface/accelerate#4202, was closed): ignored, so
    the experts are not split."""
    block = inp.accelerate.get("parallelism_config")
    if not isinstance(block, dict) or ACCELERATE_EP_KEY not in block:
        return
    file = inp.accelerate_file
    yield Finding(ERROR, "moe-accelerate-ep", file, f"parallelism_config.{ACCELERATE_EP_KEY}",
                  "accelerate has no expert-parallel size: `accelerate launch` ignores the key and the experts are "
                  "sharded like every other weight.",
                  f"{in_file(file)}remove `{ACCELERATE_EP_KEY}`; give train.py --hf_scale_config with strategy fsdp "
                  "and parallelism.ep (transformers' expert parallelism).",
                  {f"{file}:parallelism_config.{ACCELERATE_EP_KEY}": block[ACCELERATE_EP_KEY]})
