"""Checks of the YAML's ``parallelism_config:`` block (accelerate's ParallelismConfig: dp_replicate x dp_shard x tp x
cp x sp): keys `accelerate launch` ignores, sizes that are no integers, sizes that do not multiply to
``num_processes``, and the layout rules `hf-scale generate` enforces (hf_scale.config.parallelism, the one place they
live).
"""

from __future__ import annotations

from collections.abc import Iterator

from hf_scale.check.findings import ERROR, WARNING, Finding, ignored_key_severity, in_file, is_int, rename_fix
from hf_scale.check.inputs import CheckInputs, fsdp_version_of, local_model_config, world_size_of
from hf_scale.config import parallelism
from hf_scale.knowledge import rules
from hf_scale.knowledge.library_tables import known_section_keys, parallelism_value_problem

SECTION = "parallelism_config"


def _size_keys() -> list[str]:
    return [f"{parallelism.YAML_PREFIX}{name}_size" for name in parallelism.SIZES]


def check_parallelism_block(inp: CheckInputs) -> Iterator[Finding]:
    """`parallelism-key-unknown`, `parallelism-value-invalid`: a key under `parallelism_config`
    that `accelerate launch` has no option for (copied silently and ignored: an error when it misspells one), a
    size that is not an integer >= 1, a backend or cp/sp setting accelerate's own dataclasses refuse
    (`sp_backend: megatron`, `cp_comm_strategy: ring`)."""
    block = inp.accelerate.get(SECTION)
    if not isinstance(block, dict):
        return
    known = known_section_keys(SECTION)
    for key, value in block.items():
        if key == f"{parallelism.YAML_PREFIX}ep_size":
            continue  # not accelerate's, and no misspelling of sp_size: `moe-accelerate-ep` says what it is
        if key not in known:
            yield Finding(
                ignored_key_severity(key, known), "parallelism-key-unknown", inp.accelerate_file, f"{SECTION}.{key}",
                "Not an option accelerate reads: ignored without a warning (the size stays 1).",
                rename_fix(key, known, f"`{SECTION}` key", inp.accelerate_file),
                {f"{inp.accelerate_file}:{SECTION}.{key}": value},
            )
        elif key in _size_keys() and not (is_int(value) and value >= 1):
            yield Finding(
                ERROR, "parallelism-value-invalid", inp.accelerate_file, f"{SECTION}.{key}",
                f"`{SECTION}.{key}`={value!r} must be an integer >= 1: accelerate's ParallelismConfig refuses it "
                "when the processes start.",
                f"{in_file(inp.accelerate_file)}write `{SECTION}.{key}` as a whole number >= 1.",
                {f"{inp.accelerate_file}:{SECTION}.{key}": value},
            )
        elif problem := parallelism_value_problem(key, value):
            yield Finding(
                ERROR, "parallelism-value-invalid", inp.accelerate_file, f"{SECTION}.{key}",
                f"`{SECTION}.{key}`={value!r} {problem} (when the processes start).",
                f"{in_file(inp.accelerate_file)}set `{SECTION}.{key}` to a value accelerate allows, or remove it for "
                "accelerate's default.",
                {f"{inp.accelerate_file}:{SECTION}.{key}": value},
            )


def yaml_layout(inp: CheckInputs) -> parallelism.Layout | None:
    """The sizes of the YAML's parallelism_config, or None (no block, or sizes `parallelism-value-invalid`)."""
    block = inp.accelerate.get(SECTION)
    if not isinstance(block, dict) or not block:
        return None
    if not all(is_int(block.get(key, 1)) and block.get(key, 1) >= 1 for key in _size_keys()):
        return None  # `parallelism-value-invalid`
    return parallelism.layout_from_yaml_block(block)


def check_parallelism_layout(inp: CheckInputs) -> Iterator[Finding]:
    """`parallelism-size-mismatch`, `parallelism-unsupported`: the sizes do not multiply to
    `num_processes` (accelerate raises once the processes started); TP/CP/SP with a strategy that cannot run them,
    data-parallel sizes the strategy gives no meaning (dp_shard under MULTI_GPU, dp_replicate under DEEPSPEED),
    CP with SP, a TP group larger than a machine or not dividing its processes (an error, as in `hf-scale
    generate`: an accelerate YAML has no key that accepts TP across machines on purpose), an sp_attn_implementation
    hf_scale's Ulysses does not run (parallelism.sp_attn_problem, train.py's rule)."""
    layout = yaml_layout(inp)
    world = world_size_of(inp)
    if layout is None or world is None:
        return
    where = {f"{inp.accelerate_file}:{key}": inp.accelerate[SECTION].get(key, 1) for key in _size_keys()}
    # accelerate skips its own total-size check for DeepSpeed's sp (DeepSpeed builds the groups); train.py does not:
    # its --hf_scale_config's sizes multiply to the world size, and the launcher's must be the same.
    if layout.world_size != world:
        shown = " x ".join(f"{name}({size})" for name, size in layout.sizes().items())
        yield Finding(
            ERROR, "parallelism-size-mismatch", inp.accelerate_file, SECTION,
            f"{shown} = {layout.world_size}, but num_processes is {world}: accelerate raises \"ParallelismConfig "
            "total_size does not match num_processes\" after the processes start.",
            f"{in_file(inp.accelerate_file)}make the `{SECTION}` sizes multiply to `num_processes` ({world}).",
            {**where, f"{inp.accelerate_file}:num_processes": world},
        )
        return
    key = f"{parallelism.YAML_PREFIX}sp_attn_implementation"
    attn = inp.accelerate[SECTION].get(key)
    problem = None if parallelism_value_problem(key, attn) else parallelism.sp_attn_problem(
        layout, None if attn is None else str(attn), SECTION)
    if problem:  # train.py's own rule: it stops on it at start
        yield Finding(ERROR, "parallelism-unsupported", inp.accelerate_file, f"{SECTION}.{key}",
                      f"{problem}: train.py stops on it at start.",
                      f"{in_file(inp.accelerate_file)}set `{SECTION}.{key}` to "
                      f"{parallelism.SP_ATTN_IMPLEMENTATIONS[0]} or remove it.",
                      {f"{inp.accelerate_file}:{SECTION}.{key}": attn})
    machines = inp.accelerate.get("num_machines", 1)
    machines = machines if is_int(machines) and machines >= 1 else 1
    strategy = rules.STRATEGY_OF_DISTRIBUTED_TYPE.get(str(inp.accelerate.get("distributed_type")), "ddp")
    errors, warnings = parallelism.layout_problems(
        layout, strategy=strategy, fsdp_version=fsdp_version_of(inp), processes_per_machine=max(world // machines, 1),
        where=SECTION)
    for severity, problems in ((ERROR, errors), (WARNING, warnings)):
        for problem in problems:
            yield Finding(
                severity, "parallelism-unsupported", inp.accelerate_file, SECTION,
                f"{problem}.",
                f"{in_file(inp.accelerate_file)}change the `{SECTION}` sizes or `distributed_type` as the problem "
                "says (`hf-scale generate --preset fsdp2_tp` / `fsdp2_cp` write valid layouts).",
                {**where, f"{inp.accelerate_file}:distributed_type": inp.accelerate.get("distributed_type")},
            )


def check_parallelism_model(inp: CheckInputs) -> Iterator[Finding]:
    """`parallelism-unsupported`: what train.py refuses for the layout before the model loads, said from
    the files when training args are given: ep that the model's experts or its missing EP plan rule out, tp or sp
    not dividing the model's attention and key/value heads, attention context parallelism cannot compute (a local
    config.json, or the embedded model train.py defaults to), cp or sp with --packing or a kernel other than SDPA,
    tp or ep with --lora_r (hf_scale.contract.parallel_refusals: model_problem, flag_refusal: train.py's words)."""
    if inp.training is None:
        return
    layout, file, key = yaml_layout(inp), inp.accelerate_file, SECTION
    cfg = inp.hf_scale_config
    if cfg is not None and (layout is None or layout.model_parallel_size == 1 or cfg.layout.ep > 1):
        layout, file, key = cfg.layout, inp.hf_scale_config_file, "parallelism"  # ep is only ever the config's
    if layout is None or (layout.model_parallel_size == 1 and layout.ep == 1):
        return
    from hf_scale.contract import parallel_refusals

    problem = parallel_refusals.flag_refusal(layout, packing=bool(inp.training.get("packing")),
                                             attn_implementation=str(inp.training.get("attn_implementation", "auto")),
                                             lora_r=int(inp.training.get("lora_r") or 0), where=key)
    config = None if problem else local_model_config(inp)
    if config is not None:
        problem = parallel_refusals.model_problem(layout, config, key)
    if problem:
        yield Finding(ERROR, "parallelism-unsupported", file, key, f"{problem} (train.py stops on it before the "
                      "model loads).", f"{in_file(file)}change `{key}` as the problem says, or the flag it names.",
                      {f"{file}:{key}": layout.describe()})




def check_launched_fsdp(inp: CheckInputs) -> Iterator[Finding]:
    """`fsdp-setting-not-run`: an FSDP YAML with tp > 1 in its parallelism_config, run by train.py without
    --hf_scale_config, is not sharded by accelerate's plugin: train.py reads the fsdp settings back from what
    `accelerate launch` exports (contract.accelerate_fsdp.fsdp_settings_from_launch, the generator's own table) and
    has transformers shard the model with them. Each fsdp_config key whose value that table does not give back (the
    section the generator writes for the settings read back) is one line: the YAML's value, and what train.py runs."""
    layout = yaml_layout(inp)
    if (inp.hf_scale_config is not None or inp.launch_env is None or layout is None or layout.tp <= 1
            or inp.accelerate.get("distributed_type") != "FSDP"):
        return
    from hf_scale.config.distributed_config import DistributedConfig
    from hf_scale.contract.accelerate_fsdp import fsdp_settings_from_launch
    from hf_scale.generators.accelerate_yaml import accelerate_config

    settings = fsdp_settings_from_launch(inp.launch_env)
    cfg = DistributedConfig.model_validate({"strategy": "fsdp", "fsdp": settings.model_dump()})
    runs = accelerate_config(cfg, deepspeed_config_file=None)["fsdp_config"]
    written = inp.accelerate.get("fsdp_config")
    for key, value in (written.items() if isinstance(written, dict) else ()):
        if key in runs and str(value).strip().lower() != str(runs[key]).lower():
            yield Finding(
                WARNING, "fsdp-setting-not-run", inp.accelerate_file, f"fsdp_config.{key}",
                f"`fsdp_config.{key}`={value!r}, but train.py runs {key}={runs[key]!r}: under tp={layout.tp} it "
                "shards the model itself with the fsdp settings it reads back from the YAML, and this value is not "
                "one of them.",
                f"{in_file(inp.accelerate_file)}set `fsdp_config.{key}` to {runs[key]!r}, or write the run as an "
                "hf_scale config (`hf-scale generate`) and pass --hf_scale_config.",
                {f"{inp.accelerate_file}:fsdp_config.{key}": value})
