"""Runtime guard: before the first optimizer step, prove that what runs is what was asked for.

accelerate, DeepSpeed and the launchers fall back silently in several ways (each one is built for real in
tests/train/setup/test_guard.py): N processes that each train alone (`DistributedType.NO`), a
`--cpu` launch that starts one process instead of N, FSDP quietly replaced by DDP or by nothing,
a DeepSpeed config whose batch or precision disagrees with the flags. :func:`observe` reads the
live objects; :func:`find_problems` compares them with :class:`Expected`; :func:`verify_runtime`
stops the run with one line naming every problem.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hf_scale.contract.launch_request import RuntimeGuardError
from hf_scale.knowledge import rules


@dataclass(frozen=True)
class Expected:
    strategy: str
    """single | ddp | deepspeed | fsdp, as requested by the launcher / flags / hf_scale config."""
    world_size: int
    """`WORLD_SIZE` from the launcher."""
    micro_batch_size: int
    gradient_accumulation_steps: int
    precision: str
    """no | bf16 | fp16, from --bf16/--fp16."""
    zero_stage: int | None = None
    zero3_init: bool = False
    """ZeRO-3 should have built the model partitioned (HfDeepSpeedConfig alive before from_pretrained)."""
    fsdp_version: int | None = None
    """FSDP's version (1 or 2) the model must be wrapped with, when the strategy is fsdp and the request knows it."""
    tp: int = 1
    """Tensor-parallel size: the model's weights must be DTensors split tp ways (transformers' tp_size)."""
    cp: int = 1
    """Context-parallel size: accelerate's ParallelismConfig must have it (its prepare applies the ring attention)."""
    ep: int = 1
    """Expert-parallel size: each rank must hold 1/ep of every MoE layer's routed experts."""
    sp: int = 1
    """Sequence-parallel size: DeepSpeed's batch counts the data-parallel ranks only (world size / sp)."""


@dataclass(frozen=True)
class Observed:
    world_size: int
    """Size of the live process group (1 when none)."""
    distributed_type: str
    num_processes: int
    wrapper: str
    """What the prepared model is: deepspeed | ddp | fsdp2 | fsdp1 | none."""
    micro_batch_size: int | None
    mixed_precision: str
    deepspeed: dict | None = None
    """engine facts (deepspeed_engine_facts): zero_stage, micro_batch_size, gradient_accumulation_steps,
    train_batch_size, gradient_clipping, precision."""
    zero3_partitioned: bool | None = None
    single_process_cpu_launch: bool = False
    """accelerate's simple launcher started 1 process although num_processes > 1 was asked (use_cpu)."""
    tp: int = 1
    """The model's tensor-parallel size (transformers' tp_size; 1 when not built on a mesh)."""
    cp: int = 1
    """The context-parallel size of accelerate's ParallelismConfig (1 without one)."""
    ep: int = 1
    """How many ways the model's routed experts are split (all experts / the ones one rank holds; 1: dense, or not
    split)."""


def deepspeed_engine_facts(engine) -> dict:
    """What a DeepSpeedEngine runs with, from the engine itself."""
    return {
        "zero_stage": engine.zero_optimization_stage(),
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "train_batch_size": engine.train_batch_size(),
        "gradient_clipping": engine.gradient_clipping(),
        "precision": rules.precision_from_flags(engine.bfloat16_enabled(), engine.fp16_enabled()),
    }


def is_deepspeed_engine(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


def _wrapper_kind(model) -> str:
    from torch.nn.parallel import DistributedDataParallel

    if is_deepspeed_engine(model):
        return "deepspeed"
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    try:
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(module, FSDPModule) for module in model.modules()):
            return "fsdp2"
    except ImportError:  # torch < 2.6
        pass
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return "fsdp1"
    return "none"


def observe(
    accelerator, model, micro_batch_size: int | None, *, loaded_partitioned: bool | None = None
) -> Observed:
    """Collect the live facts from the prepared model and accelerate's state.

    `loaded_partitioned` is :func:`zero3_weights_partitioned` measured right after `from_pretrained`
    (after `deepspeed.initialize` every parameter is partitioned either way).
    """
    import torch.distributed as dist

    state = accelerator.state
    wrapper = _wrapper_kind(model)
    deepspeed = None
    if wrapper == "deepspeed":
        deepspeed = deepspeed_engine_facts(model)
    single_cpu_launch = (
        os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"
        and "MASTER_ADDR" in os.environ
        and "WORLD_SIZE" not in os.environ
    )
    return Observed(
        world_size=dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        distributed_type=state.distributed_type.name,
        num_processes=state.num_processes,
        wrapper=wrapper,
        micro_batch_size=micro_batch_size,
        mixed_precision=str(state.mixed_precision),
        deepspeed=deepspeed,
        zero3_partitioned=loaded_partitioned,
        single_process_cpu_launch=single_cpu_launch,
        tp=getattr(model, "tp_size", None) or 1,
        cp=getattr(getattr(state, "parallelism_config", None), "cp_size", None) or 1,
        ep=expert_split(model),
    )


def expert_split(model) -> int:
    """How many ways transformers split the model's routed experts: the config's expert count over the count an
    experts module holds after its expert-parallel plan (GroupedGemmParallel sets ``num_experts`` to the local count
    and marks the module ``_is_expert_parallel``); 1 when no module is split."""
    from hf_scale.config.expert_parallel import expert_counts

    local = next((m.num_experts for m in model.modules() if getattr(m, "_is_expert_parallel", False)), None)
    if local is None:
        return 1
    config = next(m.config for m in model.modules() if hasattr(m, "config"))  # under a DDP/DeepSpeed wrapper too
    routed, _, _ = expert_counts(config)
    return routed // local if routed and local else 1


def find_problems(expected: Expected, observed: Observed) -> list[str]:
    problems: list[str] = []
    if observed.single_process_cpu_launch:
        problems.append(
            "accelerate started ONE process although the config asks for several with use_cpu/--cpu "
            "(its simple launcher cannot start N CPU processes); set use_cpu: false or launch with torchrun"
        )
    if observed.world_size != expected.world_size or observed.num_processes != expected.world_size:
        problems.append(
            f"the launcher started WORLD_SIZE={expected.world_size} processes but the live process group has "
            f"{observed.world_size} (accelerate sees {observed.num_processes})"
        )
    if expected.world_size > 1 and observed.distributed_type == "NO":
        problems.append(
            f"{expected.world_size} processes run but accelerate's state is DistributedType.NO: every process "
            "would train alone with no gradient sync (on CPU this needs the gloo backend)"
        )

    wanted = expected.strategy
    if wanted == "deepspeed":
        if observed.distributed_type != "DEEPSPEED" or observed.wrapper != "deepspeed":
            problems.append(
                f"DeepSpeed was requested but accelerate runs {observed.distributed_type} and the model is "
                f"wrapped as {observed.wrapper!r}"
            )
    elif wanted == "fsdp":
        if observed.wrapper not in ("fsdp2", "fsdp1"):
            problems.append(
                f"FSDP was requested but the model is not sharded (accelerate runs {observed.distributed_type}, "
                f"model wrapper {observed.wrapper!r}); FSDP through accelerate needs GPUs"
            )
        elif expected.fsdp_version is not None and observed.wrapper != f"fsdp{expected.fsdp_version}":
            problems.append(f"FSDP version {expected.fsdp_version} was requested but the model is wrapped by "
                            f"{observed.wrapper.upper()}")
    elif wanted == "ddp" and observed.wrapper != "ddp" and expected.tp == 1:  # tp = world: no DDP (tp check below)
        problems.append(
            f"DDP over {expected.world_size} processes was requested but the model is wrapped as "
            f"{observed.wrapper!r} (accelerate runs {observed.distributed_type}): gradients would not be synced"
        )

    if observed.tp != expected.tp:
        problems.append(f"tensor parallelism of {expected.tp} was requested but the model is built with tp_size "
                        f"{observed.tp}")
    if observed.ep != expected.ep:
        problems.append(f"expert parallelism of {expected.ep} was requested but the model's routed experts are split "
                        f"{observed.ep} way(s)")
    if observed.cp != expected.cp:
        problems.append(f"context parallelism of {expected.cp} was requested but accelerate runs cp_size "
                        f"{observed.cp}: its prepare would not apply the ring attention")

    ds = observed.deepspeed
    if ds is not None:
        if expected.zero_stage is not None and ds["zero_stage"] != expected.zero_stage:
            problems.append(
                f"ZeRO stage {expected.zero_stage} was requested but the engine runs stage {ds['zero_stage']}"
            )
        if ds["micro_batch_size"] != expected.micro_batch_size:
            problems.append(
                f"DeepSpeed train_micro_batch_size_per_gpu={ds['micro_batch_size']} but "
                f"--per_device_train_batch_size={expected.micro_batch_size}"
            )
        if ds["gradient_accumulation_steps"] != expected.gradient_accumulation_steps:
            problems.append(
                f"DeepSpeed gradient_accumulation_steps={ds['gradient_accumulation_steps']} but "
                f"--gradient_accumulation_steps={expected.gradient_accumulation_steps}"
            )
        data_parallel = expected.world_size // expected.sp
        implied = rules.global_batch_size(expected.micro_batch_size, expected.gradient_accumulation_steps,
                                          data_parallel)
        if ds["train_batch_size"] != implied:
            problems.append(
                f"DeepSpeed train_batch_size={ds['train_batch_size']} but micro {expected.micro_batch_size} x "
                f"accumulation {expected.gradient_accumulation_steps} x data-parallel ranks {data_parallel} "
                f"= {implied}"
            )
        if ds["precision"] != rules.compute_precision(expected.precision):  # fp8 runs on DeepSpeed's bf16
            problems.append(
                f"DeepSpeed runs precision {ds['precision']} but the flags ask for {expected.precision}"
            )
        if expected.zero_stage == 3 and expected.zero3_init and observed.zero3_partitioned is False:
            problems.append(
                "ZeRO-3 with zero3_init: the model was built unpartitioned (every process held the full "
                "weights); the DeepSpeed config must exist before from_pretrained"
            )
    else:
        if observed.micro_batch_size is not None and observed.micro_batch_size != expected.micro_batch_size:
            problems.append(
                f"the data loader yields micro-batches of {observed.micro_batch_size} but "
                f"--per_device_train_batch_size={expected.micro_batch_size}"
            )
        if observed.mixed_precision != expected.precision:
            problems.append(
                f"accelerate runs mixed_precision={observed.mixed_precision} but the flags ask for {expected.precision}"
            )
    return problems


def verify_runtime(expected: Expected, observed: Observed) -> None:
    problems = find_problems(expected, observed)
    if problems:
        raise RuntimeGuardError("runtime guard: " + "; ".join(problems))


def expected_precision(bf16: bool, fp16: bool) -> str:
    return rules.precision_from_flags(bf16, fp16)


def zero3_weights_partitioned(model) -> bool:
    """True when every weight `from_pretrained` loaded is a ZeRO-3 partition (empty locally) — the zero.Init
    load path. LoRA adapters are created afterwards, outside zero.Init (deepspeed.initialize partitions them),
    so for a peft model only the frozen base weights count."""
    is_peft = hasattr(model, "peft_config")
    params = [p for p in model.parameters() if not (is_peft and p.requires_grad)]
    return bool(params) and all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
