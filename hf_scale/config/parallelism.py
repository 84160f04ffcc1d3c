"""Tensor, context and sequence parallelism: the sizes of accelerate's ``ParallelismConfig`` and their rules.

One place computes the layout of a run (dp_replicate x dp_shard x tp x cp x sp = world size) and every rule a
layout must obey before launch. The config (``DistributedConfig.parallelism``), the accelerate YAML generator,
``hf-scale check`` (users' own ``parallelism_config:`` blocks), the planner and train.py all call these
functions, so a rule cannot say one thing in one command and another in the next.

accelerate's own ParallelismConfig is the authority on what it builds (its mesh order is dp_replicate, dp_shard,
cp, sp, tp: TP ranks are neighbours, so a TP group stays inside a machine when tp divides the processes per
machine); the rules here are the ones it only discovers after the processes started (or never: a TP group that
spans machines runs, slowly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from packaging.version import Version
from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool

from hf_scale.config import expert_parallel
from hf_scale.knowledge.installed import PYTHON, version_of

SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
"""The mesh dimensions, in the order the rule messages name them."""
YAML_PREFIX = "parallelism_config_"
"""accelerate's key prefix inside the YAML's ``parallelism_config:`` block (commands/config/cluster.py)."""
CP_ATTENTION = ("sdpa",)
"""Attention kernels torch's context_parallel shards (it replaces F.scaled_dot_product_attention); eager and
flash_attention_2 bypass it and would attend only to the local chunk."""
CP_COMM_STRATEGIES = ("allgather", "alltoall")

# What each kind needs. torch: accelerate/utils/constants.py (BETA_TP/BETA_CP_AVAILABLE_PYTORCH_VERSION).
# accelerate: ParallelismConfig (tp, cp, maybe_context_parallel) appeared in 1.10, its DeepSpeed sp backend in 1.12.
# deepspeed: accelerate's BETA_SP_AVAILABLE_DEEPSPEED_VERSION. transformers for tp: train.py builds the model with
# `from_pretrained(distributed_config=DistributedConfig(tp_size, fsdp_size, dp_replicate_size))` and clips with
# `Trainer._mixed_mesh_grad_norm`; transformers 4.x's DistributedConfig has only `enable_expert_parallel`, the sizes
# arrived during 5.x (huggingface/transformers#44996, then dp_replicate_size), so the floor is the release this path
# is proven with (tests/train/model/test_parallelize.py), not an older one it might run on. transformers 5.24 requires
# Python 3.11 (on 3.10 pip stops at an older 5.x): named first, since upgrading transformers cannot help there.
NEEDS: dict[str, dict[str, str]] = {
    "tp": {PYTHON: "3.11", "torch": "2.3.0", "accelerate": "1.10.0", "transformers": "5.24.0"},
    "cp": {"torch": "2.6.0", "accelerate": "1.10.0"},
    "sp": {"accelerate": "1.12.0", "deepspeed": "0.18.2", "transformers": "4.54.0"},
    "hsdp": {"torch": "2.6.0", "accelerate": "1.10.0"},
    # ep_size and the all-to-all token dispatch arrived during transformers 5.x (the release this path is proven
    # with); DistributedConfig._validate_resolved_ep_plan: "Expert-parallel token dispatch requires torch>=2.7".
    "ep": {PYTHON: "3.11", "torch": "2.7.0", "transformers": "5.24.0"},
}

Size = Annotated[int, Strict(), Field(ge=1, le=16_384)]


class ParallelismSettings(BaseModel):
    """How the world's processes split into data-parallel replicas and shards, tensor-, context- and
    sequence-parallel groups (accelerate's ParallelismConfig). Their product is the world size; a size left out
    is derived: the strategy's data-parallel dimension takes what the others leave (dp_shard for fsdp and
    deepspeed, dp_replicate for ddp; dp_replicate = num_machines under fsdp hybrid_shard), the rest are 1."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dp_replicate: Size | None = None
    """Data-parallel replicas (each holds a whole copy of what dp_shard shards): DDP, or HSDP's replicate dimension
    (not with strategy deepspeed, whose ZeRO groups are DeepSpeed's own)."""
    dp_shard: Size | None = None
    """Data-parallel ranks that shard parameters, gradients and optimizer states (FSDP2 / ZeRO); 1 with strategy ddp."""
    tp: Size | None = None
    """Tensor-parallel ranks: each layer's weights split across them (transformers tp_plan="auto"); keep it inside
    one machine."""
    cp: Size | None = None
    """Context-parallel ranks (FSDP2 only): each holds 1/cp of every sequence; ring attention over SDPA."""
    sp: Size | None = None
    """Sequence-parallel ranks (DeepSpeed Ulysses/ALST, strategy deepspeed): heads exchanged by all-to-all."""
    ep: Size | None = None
    """Expert-parallel ranks of a mixture-of-experts model (strategy fsdp, fsdp.version 2): each holds 1/ep of the
    routed experts and tokens reach them by all-to-all (transformers' DistributedConfig(ep_size)). Not a mesh
    dimension of its own: a multiple of tp dividing dp_shard x tp, and a divisor of the model's experts; keep it
    inside one machine. hf_scale.config.expert_parallel."""
    cp_comm_strategy: Literal["allgather", "alltoall"] = "allgather"
    """How context-parallel ranks exchange keys/values (accelerate's cp_comm_strategy)."""
    tp_across_machines: StrictBool = False
    """Allow a tensor-parallel group to span machines (its all-reduces then cross the slow link: a warning)."""
    ep_across_machines: StrictBool = False
    """Allow an expert-parallel group to span machines (its all-to-alls then cross the slow link: a warning)."""


@dataclass(frozen=True)
class Layout:
    """A resolved layout: every size an integer."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sp: int = 1
    ep: int = 1
    """Expert-parallel ranks, carved out of dp_shard x tp (no factor of the world size;
    hf_scale.config.expert_parallel)."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp * self.sp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: batch arithmetic, gradient accumulation and the loss's token count
        count these only (the ranks of one TP/CP/SP group see the same batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one TP x CP x SP group (they see the same batch)."""
        return self.tp * self.cp * self.sp

    @property
    def whole_batch_copies(self) -> int:
        """Ranks of one group that hold the same rows whole (TP's): a count summed over all ranks is divided by
        this. CP and SP ranks hold disjoint pieces of the sequences, whose sum is the whole once."""
        return self.tp

    @property
    def loader_copies(self) -> int:
        """Ranks of one group that get the same loader batch whole (TP's, and CP's: context parallelism shards it
        only inside the forward): a count taken from the loader's batches, summed over all ranks, is divided by this.
        SP's adapter shards the batches before the loop sees them."""
        return self.tp * self.cp

    @property
    def active(self) -> bool:
        """Anything beyond what the strategy does alone: TP, CP, SP or an HSDP replicate dimension."""
        return self.model_parallel_size > 1 or (self.dp_replicate > 1 and self.dp_shard > 1)

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SIZES}

    def describe(self) -> str:
        """The sizes above 1 (ep last, in brackets: it splits the experts of the ranks before it)."""
        shown = " x ".join(f"{name}={size}" for name, size in self.sizes().items() if size > 1) or "one process"
        return shown + (f" (ep={self.ep})" if self.ep > 1 else "")


class LayoutError(ValueError):
    """A layout rule is broken; the message is one line naming the field, the value and what is allowed."""


def _free_dimension(strategy: str) -> str | None:
    """The data-parallel dimension a strategy derives from the world size."""
    return {"ddp": "dp_replicate", "deepspeed": "dp_shard", "fsdp": "dp_shard"}.get(strategy)


def resolve(
    settings: ParallelismSettings,
    *,
    strategy: str,
    num_machines: int,
    processes_per_machine: int,
    hybrid: bool = False,
    where: str = "parallelism",
) -> Layout:
    """The layout ``settings`` describe for this strategy and topology (sizes left out derived), or LayoutError."""
    world = num_machines * processes_per_machine
    given = {name: getattr(settings, name) for name in SIZES}
    if hybrid and given["dp_replicate"] is None:
        given["dp_replicate"] = num_machines
    free = _free_dimension(strategy)
    if free is not None and given[free] is None:
        fixed = math.prod(size or 1 for size in given.values())
        if world % fixed:
            raise LayoutError(_product_message(given, world, where, free))
        given[free] = world // fixed
    layout = Layout(**{name: size or 1 for name, size in given.items()}, ep=settings.ep or 1)
    if layout.world_size != world:
        raise LayoutError(_product_message(given, world, where, None))
    return layout


def _product_message(given: dict[str, int | None], world: int, where: str, free: str | None) -> str:
    shown = " x ".join(f"{name}({'?' if size is None and name == free else size or 1})" for name, size in given.items())
    return (
        f"{where}: {shown} must multiply to the world size {world} (num_machines x processes_per_machine); "
        "change the sizes so that their product is the world size"
    )


def layout_problems(
    layout: Layout,
    *,
    strategy: str,
    fsdp_version: int | None,
    processes_per_machine: int,
    tp_across_machines: bool = False,
    ep_across_machines: bool = False,
    where: str = "parallelism",
) -> tuple[list[str], list[str]]:
    """(refusals, warnings) of a resolved layout under a strategy, one line each. The refusals are the ones
    accelerate, torch or transformers raise only after launch, or never (a TP group across machines)."""
    errors: list[str] = []
    warnings: list[str] = []
    tp, cp, sp = layout.tp, layout.cp, layout.sp
    if strategy == "single" and layout.world_size > 1:
        errors.append(f"{where}: strategy single runs one process; sizes {layout.describe()} need several")
    # Which data-parallel sizes mean something is the strategy's: DDP shards nothing, and DeepSpeed partitions ZeRO
    # over all its data-parallel ranks with its own groups. Without these two, a "ddp" layout with dp_shard x tp would
    # run FSDP2 (train/model/parallel.py hands dp_shard to transformers as fsdp_size) and a "deepspeed" one with
    # dp_replicate would describe replicas DeepSpeed never makes.
    if strategy in ("ddp", "single") and layout.dp_shard > 1:
        errors.append(f"{where}.dp_shard={layout.dp_shard} with strategy {strategy}: DDP keeps a whole copy on every "
                      "rank and shards nothing (with tp > 1 train.py would shard with FSDP2 anyway); allowed with ddp: "
                      "dp_shard=1 (leave it out); to shard, use strategy fsdp (e.g. preset fsdp2_tp)")
    if strategy == "deepspeed" and layout.dp_replicate > 1:
        errors.append(f"{where}.dp_replicate={layout.dp_replicate} with strategy deepspeed: ZeRO partitions over all "
                      "its data-parallel ranks with DeepSpeed's own groups, so there are no replicas to size; allowed "
                      "with deepspeed: dp_replicate=1 (leave it out; dp_shard is derived as world size / sp)")
    if cp > 1 and sp > 1:
        errors.append(f"{where}.cp={cp} and {where}.sp={sp} together: accelerate allows one of context and "
                      "sequence parallelism (cp for FSDP2, sp for DeepSpeed)")
    if cp > 1 and not (strategy == "fsdp" and fsdp_version == 2):
        errors.append(f"{where}.cp={cp} needs strategy fsdp with fsdp.version=2 (got strategy={strategy}"
                      f"{f', fsdp.version={fsdp_version}' if strategy == 'fsdp' else ''}): context parallelism "
                      "shards sequences over FSDP2's mesh; use preset fsdp2_cp")
    if tp > 1 and strategy == "deepspeed":
        errors.append(f"{where}.tp={tp} with strategy deepspeed: ZeRO cannot shard tensor-parallel DTensors; use "
                      "strategy fsdp (FSDP2 x TP, preset fsdp2_tp) or parallelism.sp with DeepSpeed")
    if tp > 1 and strategy == "fsdp" and fsdp_version != 2:
        errors.append(f"{where}.tp={tp} needs fsdp.version=2 (got {fsdp_version}): FSDP1 cannot wrap DTensors")
    if tp > 1 and strategy == "ddp" and layout.dp_replicate > 1:
        errors.append(f"{where}.tp={tp} with strategy ddp and dp_replicate={layout.dp_replicate}: accelerate cannot "
                      "compose DDP and TP; use strategy fsdp (dp_shard x tp, preset fsdp2_tp), or tp = world size")
    if tp > 1 and cp > 1:
        # accelerate composes them on its own mesh; hf_scale's TP is built by transformers at load, on a mesh
        # accelerate's context_parallel does not share (train/model/parallel.py). The planner offers neither; a peer
        # project's YAML (accelerate's nd.yaml) asks for both.
        errors.append(f"{where}.tp={tp} with {where}.cp={cp}: hf_scale's train.py runs TP or CP, not both (its TP "
                      "mesh is transformers', which context parallelism does not use); set one of them to 1")
    if sp > 1 and strategy != "deepspeed":
        errors.append(f"{where}.sp={sp} needs strategy deepspeed (got {strategy}): sequence parallelism is "
                      "DeepSpeed's Ulysses/ALST (accelerate's sp_backend deepspeed); for FSDP2 use cp")
    if strategy == "fsdp" and layout.dp_replicate > 1 and layout.dp_shard == 1 and layout.active:
        errors.append(f"{where}.dp_replicate={layout.dp_replicate} with dp_shard=1: accelerate refuses TP/CP over "
                      "pure replication; give dp_shard > 1")
    if strategy == "fsdp" and fsdp_version == 2 and layout.active and layout.dp_shard * cp == 1:
        errors.append(f"{where}: strategy fsdp with dp_shard=1 and cp=1 leaves FSDP2 nothing to shard over "
                      f"({layout.describe()}); use strategy ddp for pure tensor parallelism or lower tp")
    if tp > 1 and (tp > processes_per_machine or processes_per_machine % tp):
        spans = (f"{where}.tp={tp} does not fit inside one machine of {processes_per_machine} processes "
                 f"(tp must divide topology.processes_per_machine={processes_per_machine})")
        if tp_across_machines:
            warnings.append(f"{spans}: TP's all-reduces of every layer cross the machines' link "
                            f"({where}.tp_across_machines=true)")
        else:
            errors.append(f"{spans}: TP all-reduces every layer's activations, too slow across machines; "
                          f"allowed: a divisor of {processes_per_machine}, or set "
                          f"{where}.tp_across_machines=true to accept it")
    ep_errors, ep_warnings = expert_parallel.layout_problems(
        layout, strategy=strategy, fsdp_version=fsdp_version, processes_per_machine=processes_per_machine,
        ep_across_machines=ep_across_machines, where=where)
    return errors + ep_errors, warnings + ep_warnings


def head_problem(layout: Layout, num_attention_heads: int, num_key_value_heads: int,
                 where: str = "parallelism") -> str | None:
    """Why the model's heads cannot split over tp (and sp), or None. Each TP rank holds whole heads; Ulysses
    SP scatters heads over the sp ranks."""
    for name in ("tp", "sp"):
        size = getattr(layout, name)
        if size <= 1:
            continue
        heads_of = (("num_attention_heads", num_attention_heads), ("num_key_value_heads", num_key_value_heads))
        for field, heads in heads_of:
            if heads % size:
                divisors = [d for d in range(1, heads + 1) if heads % d == 0 and num_attention_heads % d == 0]
                return (f"{where}.{name}={size} does not divide the model's {field}={heads}: each rank must hold "
                        f"whole heads; allowed {name}: {', '.join(map(str, divisors))}")
    return None


def config_layout(cfg: Any) -> Layout:
    """The layout of a DistributedConfig (LayoutError when its sizes do not multiply to the world size)."""
    topo = cfg.topology
    return resolve(cfg.parallelism, strategy=cfg.strategy, num_machines=topo.num_machines,
                   processes_per_machine=topo.processes_per_machine,
                   hybrid=cfg.strategy == "fsdp" and cfg.fsdp.version == 2 and cfg.fsdp.sharding == "hybrid_shard")


def _config_problems(cfg: Any) -> tuple[list[str], list[str]]:
    layout = config_layout(cfg)
    errors, warnings = layout_problems(layout, strategy=cfg.strategy, fsdp_version=cfg.fsdp.version,
                                       processes_per_machine=cfg.topology.processes_per_machine,
                                       tp_across_machines=cfg.parallelism.tp_across_machines,
                                       ep_across_machines=cfg.parallelism.ep_across_machines)
    return errors, warnings


def checked_layout(cfg: Any) -> Layout:
    """The config's layout after every rule (DistributedConfig's validator: a ValueError becomes one line)."""
    errors, _ = _config_problems(cfg)
    if errors:
        raise ValueError(errors[0])
    return config_layout(cfg)


def layout_warnings(cfg: Any) -> list[str]:
    """Risky-but-allowed layout choices of a valid config (a TP group across machines)."""
    return _config_problems(cfg)[1]


# --- accelerate's YAML block ----------------------------------------------------------------------------------


def yaml_block(layout: Layout, *, cp_comm_strategy: str = "allgather") -> dict[str, Any]:
    """The ``parallelism_config:`` block as ``accelerate config`` writes it (dp_replicate, dp_shard, tp, cp sizes;
    the cp communication strategy when cp > 1) plus the sp keys `accelerate launch` reads when sp > 1."""
    block: dict[str, Any] = {
        YAML_PREFIX + "dp_replicate_size": layout.dp_replicate,
        YAML_PREFIX + "dp_shard_size": layout.dp_shard,
        YAML_PREFIX + "tp_size": layout.tp,
        YAML_PREFIX + "cp_size": layout.cp,
    }
    if layout.cp > 1:
        block[YAML_PREFIX + "cp_comm_strategy"] = cp_comm_strategy
    if layout.sp > 1:
        block[YAML_PREFIX + "sp_size"] = layout.sp
        block[YAML_PREFIX + "sp_backend"] = "deepspeed"
    return block


def layout_from_yaml_block(block: dict[str, Any]) -> Layout:
    """The sizes of a ``parallelism_config:`` block (absent keys are accelerate's default 1). Values must already
    be integers (``hf-scale check`` reports the others)."""
    return Layout(**{name: int(block.get(f"{YAML_PREFIX}{name}_size", 1)) for name in SIZES})


# --- what this node can run -----------------------------------------------------------------------------------


def version_problem(kind: str) -> str | None:
    """Why this node's torch/accelerate/transformers/deepspeed cannot run ``kind`` (tp, cp, sp, hsdp), or None."""
    for package, needed in NEEDS[kind].items():
        have = Version(written) if (written := version_of(package)) else None
        if have is None or have.release < Version(needed).release:
            shown = "not installed" if have is None else f"{have} is installed"
            if package == PYTHON:
                return (f"{kind} needs Python >= {needed} ({have} runs here; transformers >= "
                        f"{NEEDS[kind]['transformers']} requires it): run it from a Python >= {needed} environment")
            return f"{kind} needs {package} >= {needed} ({shown}); pip install '{package}>={needed}'"
    return None


def kinds_of(layout: Layout) -> list[str]:
    """The kinds a layout uses, for version checks."""
    kinds = [name for name in ("tp", "cp", "sp", "ep") if getattr(layout, name) > 1]
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        kinds.append("hsdp")
    return kinds


# Why a kind cannot run without a GPU although the versions allow it (measured on torch 2.13 CPU). Not sp:
# DeepSpeed's Ulysses runs over gloo (tests/train/model/test_sequence_parallel.py).
_NEEDS_GPU = {
    "cp": "torch's context_parallel has no sharding strategy for the CPU SDPA kernel "
          "(aten._scaled_dot_product_flash_attention_for_cpu): it needs a CUDA GPU",
}


# What train.py does with a kind this node can run, and how far hf_scale has proven it. Not hsdp: what train.py does
# with it depends on the launcher as well (hf_scale.doctor.parallel_support.hsdp_support).
_PROVEN = {
    "tp": "train.py runs it in both loops (equal to one process on CPU: tests/train/model/test_parallelize.py)",
    "cp": "train.py runs it over FSDP2 with SDPA in both loops; proven on CPU up to the ring kernel, the cp=2 run "
          "against one process is benchmarks/gpu_cp.py (2 GPUs)",
    "sp": "train.py runs it in both loops (equal to one process on CPU: test_sequence_parallel_train.py)",
    "ep": "train.py runs it (transformers' expert-parallel plan under FSDP2, strategy fsdp with fsdp.version 2) in "
          "both loops for a mixture-of-experts model with a base_model_ep_plan (ep=2 equal to one process on CPU: "
          "tests/train/model/test_model_expert_parallel.py); its checkpoints resume at another ep or world size in "
          "the manual loop, at the same ep in the Trainer (docs/moe.md)",
}


def node_support(gpu_present: bool) -> dict[str, dict[str, Any]]:
    """For `hf-scale doctor`: whether train.py can run tp, cp, sp and ep on this node (its torch/accelerate/
    transformers/deepspeed, and a GPU where one is needed), and why not; the same rules train.py refuses with
    (train_refusal)."""
    support = {}
    for kind in _PROVEN:
        problem = version_problem(kind)
        if problem is None and not gpu_present and kind in _NEEDS_GPU:
            problem = _NEEDS_GPU[kind]
        support[kind] = {"usable": problem is None, "why": problem or f"installed versions support it; {_PROVEN[kind]}"}
    return support


def train_refusal(layout: Layout, where: str, *, gpu_present: bool) -> str | None:
    """Why train.py refuses this layout on this machine, or None: a torch/accelerate/transformers/deepspeed too old
    for one of its kinds (:func:`version_problem` names the version needed), or cp without a GPU (the ring kernel
    has no CPU implementation). train.py calls it after its flag refusals (train/setup/reconcile.py), before the
    process group and the model; what it runs otherwise: TP (alone, or under FSDP2's dp_shard / dp_replicate), CP
    over FSDP2 (train/model/context_parallel.py) and SP (sequence_parallel.py), in both loops."""
    for kind in kinds_of(layout):
        problem = version_problem(kind)
        if problem:
            return f"{where}: {layout.describe()}: {problem}"
    if layout.cp > 1 and not gpu_present:
        return f"{where}: cp={layout.cp} cannot run on this machine: {_NEEDS_GPU['cp']}; run it on GPUs, or set cp to 1"
    return None


SP_ATTN_IMPLEMENTATIONS = ("sdpa",)
"""The kernels hf_scale's Ulysses (sp > 1) runs around: the model loads with it and the Accelerator's
DeepSpeedSequenceParallelConfig gets it (hf_scale.train.model.sequence_parallel). accelerate also takes
flash_attention_2/3 and hub kernels; hf_scale has proven none of them under sp, so an accelerate YAML asking for one is
refused, not run on sdpa behind its back."""


def sp_attn_problem(layout: Layout, value: str | None, where: str) -> str | None:
    """Why hf_scale does not run the accelerate config's ``sp_attn_implementation`` (None: unset, or allowed). One rule
    for train.py (the value `accelerate launch` exported) and `hf-scale check` (the YAML's key)."""
    if layout.sp <= 1 or value is None or value in SP_ATTN_IMPLEMENTATIONS:
        return None
    return (f"{where}.sp_attn_implementation={value}: hf_scale runs Ulysses (sp={layout.sp}) around "
            f"{' or '.join(SP_ATTN_IMPLEMENTATIONS)} only; allowed: {', '.join(SP_ATTN_IMPLEMENTATIONS)} (or leave "
            "it unset)")


def launch_layout(environ: dict[str, str]) -> Layout:
    """The sizes `accelerate launch` passes the processes (PARALLELISM_CONFIG_*, utils/launch.py), 1 when unset."""
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() != "true":
        return Layout()
    sizes = {}
    for name in SIZES:
        value = environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")
        sizes[name] = int(value) if value.isdigit() and int(value) >= 1 else 1
    return Layout(**sizes)
