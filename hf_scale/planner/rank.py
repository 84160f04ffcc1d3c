"""Candidates, their expected speed, and the recommendation: the fastest candidate that fits.

Speed is a relative score, not a time prediction: it only has to order the candidates the way they run on
NVLink machines with a fast interconnect between them. The order follows the communication volume and
what crosses PCIe: DDP (one all-reduce) > ZeRO-1 (reduce-scatter + all-gather of updated weights) >
ZeRO-2 (same, gradients partitioned as they are produced) > FSDP2 / ZeRO-3 (parameters all-gathered in
forward and again in backward) > optimizer offload (the step runs on the CPU) > parameter offload (weights
cross PCIe every forward and backward). Sharding parameters across machines pays the inter-node link on
every gather, so FSDP2 hybrid (shard inside a machine, replicate across) ranks above full sharding across
machines. Activation checkpointing recomputes the forward: about 4/3 of the compute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_scale.config import DistributedConfig, validate_config
from hf_scale.planner import parallel
from hf_scale.planner.estimate import Candidate, Estimate, Workload, estimate
from hf_scale.presets import PLACEHOLDER_MAIN_IP

# Relative throughput on one machine (DDP = 1.0).
BASE_SPEED = {
    "ddp": 1.00,
    "zero1": 0.97,
    "zero2": 0.94,
    "fsdp2_hybrid_shard": 0.90,
    "fsdp2_full_shard": 0.88,
    "zero3": 0.86,
    "zero2_offload_opt": 0.55,
    "zero3_offload_opt": 0.45,
    "zero3_offload_opt_params": 0.30,
}
# Full parameter sharding across machines gathers every layer over the inter-node link.
CROSS_MACHINE_SHARDING_SPEED = 0.75
ACTIVATION_CHECKPOINTING_SPEED = 0.75
DEFAULT_SAFETY_MARGIN = 0.10
"""Fraction of GPU (and CPU) memory kept free for the CUDA context, NCCL, cuBLAS workspaces and allocator
fragmentation; the estimates are of what PyTorch allocates."""

_BASE = [
    Candidate("ddp", "DDP", "ddp"),
    Candidate("zero1", "ZeRO-1", "deepspeed", zero_stage=1),
    Candidate("zero2", "ZeRO-2", "deepspeed", zero_stage=2),
    Candidate("zero2_offload_opt", "ZeRO-2 + opt offload", "deepspeed", zero_stage=2, offload_optimizer=True),
    Candidate("zero3", "ZeRO-3", "deepspeed", zero_stage=3),
    Candidate("zero3_offload_opt", "ZeRO-3 + opt offload", "deepspeed", zero_stage=3, offload_optimizer=True),
    Candidate(
        "zero3_offload_opt_params",
        "ZeRO-3 + opt+param offload",
        "deepspeed",
        zero_stage=3,
        offload_optimizer=True,
        offload_params=True,
    ),
    Candidate("fsdp2_full_shard", "FSDP2 full shard", "fsdp"),
    Candidate("fsdp2_hybrid_shard", "FSDP2 hybrid shard", "fsdp", hybrid=True),
]


@dataclass(frozen=True)
class Assessment:
    """A candidate's estimate, speed score and verdict."""

    estimate: Estimate
    speed: float
    fits: bool
    reason: str
    """Why it does not fit ("" when it fits)."""

    @property
    def candidate(self) -> Candidate:
        return self.estimate.candidate

    @property
    def slug(self) -> str:
        """File-name friendly id including the checkpointing choice."""
        return self.candidate.key + ("_ac" if self.candidate.activation_checkpointing else "")


@dataclass(frozen=True)
class Plan:
    workload: Workload
    gpu_memory: int
    cpu_memory: int | None
    safety_margin: float
    assessments: tuple[Assessment, ...]
    """Every candidate, fastest first."""
    recommended: Assessment | None
    qlora_because: str | None = None
    """Set when the plan switched to QLoRA: why the fine-tune asked for fits no candidate."""

    @property
    def gpu_budget(self) -> int:
        return int(self.gpu_memory * (1 - self.safety_margin))

    @property
    def rejected_faster(self) -> tuple[Assessment, ...]:
        """Candidates faster than the recommendation (all of them when nothing fits)."""
        if self.recommended is None:
            return self.assessments
        return self.assessments[: self.assessments.index(self.recommended)]


def candidates(w: Workload, activation_checkpointing: str) -> list[Candidate]:
    """Every candidate that makes sense on this topology, with/without activation checkpointing as asked
    (auto: both)."""
    choices = {"on": [True], "off": [False], "auto": [False, True]}[activation_checkpointing]
    out = []
    for base in _BASE:
        if base.hybrid and (w.num_machines < 2 or w.gpus_per_machine < 2):
            continue  # hybrid needs a shard group inside each machine and more than one machine
        for ac in choices:
            out.append(replace(base, activation_checkpointing=ac))
    return out + parallel.candidates(w, out)


def speed(w: Workload, c: Candidate) -> float:
    if c.key in BASE_SPEED:
        score = BASE_SPEED[c.key]
    else:  # TP/CP candidates: the FSDP2 sharding they build on, charged for their communication
        score = parallel.speed(w, c, BASE_SPEED["fsdp2_hybrid_shard" if c.hybrid else "fsdp2_full_shard"])
    if w.num_machines > 1 and (c.zero_stage == 3 or (c.engine == "fsdp" and not c.hybrid)):
        score *= CROSS_MACHINE_SHARDING_SPEED
    if c.activation_checkpointing:
        score *= ACTIVATION_CHECKPOINTING_SPEED
    return score


def make_plan(
    w: Workload,
    *,
    gpu_memory: int,
    cpu_memory: int | None = None,
    activation_checkpointing: str = "auto",
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
) -> Plan:
    """Estimate every candidate, order them by speed, recommend the fastest that fits."""
    gpu_budget = int(gpu_memory * (1 - safety_margin))
    cpu_budget = None if cpu_memory is None else int(cpu_memory * (1 - safety_margin))
    assessed = []
    for c in candidates(w, activation_checkpointing):
        e = estimate(w, c)
        reasons = []
        if e.gpu_total > gpu_budget:
            reasons.append(
                f"needs {gib(e.gpu_total)} per GPU > {gib(gpu_budget)} usable "
                f"({gib(gpu_memory)} minus {safety_margin:.0%} margin)"
            )
        if cpu_budget is not None and e.cpu_per_machine > cpu_budget:
            reasons.append(f"needs {gib(e.cpu_per_machine)} CPU RAM per machine > {gib(cpu_budget)} usable")
        assessed.append(Assessment(e, speed(w, c), not reasons, "; ".join(reasons)))
    # Stable sort: equal speeds keep the list order (less sharding first).
    assessed.sort(key=lambda a: -a.speed)
    recommended = next((a for a in assessed if a.fits), None)
    return Plan(w, gpu_memory, cpu_memory, safety_margin, tuple(assessed), recommended)


QLORA_DEFAULT_R = 16
"""The LoRA rank a QLoRA recommendation uses when none was given (QLoRA's own experiments use 16-64)."""


def with_qlora_fallback(plan: Plan, **budget) -> Plan:
    """``plan`` when something fits (or it already is QLoRA); else the plan of the same job as QLoRA (the 4-bit base,
    LoRA rank as given or 16) when that fits, saying why the fine-tune asked for did not."""
    w = plan.workload
    if plan.recommended is not None or w.load_in_4bit:
        return plan
    qlora = make_plan(replace(w, lora_r=w.lora_r or QLORA_DEFAULT_R, load_in_4bit=True), **budget)
    if qlora.recommended is None:
        return plan
    tuning = f"LoRA (r={w.lora_r})" if w.lora_r else "full"
    best = plan.assessments[0]
    return replace(qlora, qlora_because=f"a {tuning} fine-tune fits no candidate (fastest, {best.candidate.label}: "
                                        f"{best.reason}); QLoRA (4-bit base, LoRA r={qlora.workload.lora_r}) fits")


def train_flags(plan: Plan) -> dict:
    """The train.py flags the plan decides beyond the DistributedConfig, which has no field for them: the sequence
    length (without --max_seq_length train.py trains at its own, shorter default), LoRA and the 4-bit base. generate
    writes them into the recipe; the plan prints them (:func:`train_argv`)."""
    w = plan.workload
    return {"max_seq_length": w.seq_len, "lora_r": w.lora_r or 0, **({"load_in_4bit": True} if w.load_in_4bit else {})}


def train_argv(plan: Plan) -> list[str]:
    """:func:`train_flags` as train.py's command-line flags, those at train.py's default (lora_r 0) left out."""
    argv: list[str] = []
    for name, value in train_flags(plan).items():
        if value is True:
            argv.append(f"--{name}")
        elif value:
            argv += [f"--{name}", str(value)]
    return argv


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def distributed_config(plan: Plan, assessment: Assessment) -> DistributedConfig:
    """The DistributedConfig that runs ``assessment`` on the plan's topology (validated)."""
    w, c = plan.workload, assessment.candidate
    topology: dict = {"num_machines": w.num_machines, "processes_per_machine": w.gpus_per_machine}
    if w.num_machines > 1:
        topology["main_process_ip"] = PLACEHOLDER_MAIN_IP
    data: dict = {
        "precision": w.precision,
        "activation_checkpointing": c.activation_checkpointing,
        "batch": {"micro_batch_size": w.micro_batch_size},
        "topology": topology,
    }
    if c.engine == "ddp":
        data["strategy"] = "ddp" if w.world_size > 1 else "single"
    elif c.engine == "fsdp":
        data["strategy"] = "fsdp"
        data["fsdp"] = {
            "version": 2,
            "sharding": "hybrid_shard" if c.hybrid else "full_shard",
            "transformer_layer_cls_to_wrap": [w.shapes.decoder_layer_class],
        }
        if c.offload_params:
            data["fsdp"]["offload_params"] = True
        if c.tp > 1 or c.cp > 1:
            data["parallelism"] = {"tp": c.tp, "cp": c.cp}
    else:
        data["strategy"] = "deepspeed"
        data["deepspeed"] = {
            "zero_stage": c.zero_stage,
            "offload_optimizer": "cpu" if c.offload_optimizer else "none",
            "offload_params": "cpu" if c.offload_params else "none",
        }
    return validate_config(data)


def planned_config_data(plan: Plan, assessment: Assessment) -> dict:
    """The fields the plan sets, as plain data for YAML or ``--set`` overrides. The global batch size is left
    to follow from micro batch x accumulation x world size, so a later topology override stays consistent."""
    data = distributed_config(plan, assessment).model_dump(mode="json", exclude_unset=True)
    data["batch"].pop("global_batch_size", None)
    return data
