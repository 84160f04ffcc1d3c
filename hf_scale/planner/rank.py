"""Candidates, their predicted step time, and the recommendation: the fastest candidate that fits.

"Fastest" is the most tokens per second per GPU the time model predicts (hf_scale.planner.time_model: compute,
communication of the layout over the links it crosses, optimizer step, CPU offload) on the plan's GPU profile
(hf_scale.planner.hardware); per GPU, so that TP/CP candidates, whose groups share sequences, compare with the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hf_scale.config.distributed_config import DistributedConfig, validate_config
from hf_scale.config.presets import PLACEHOLDER_MAIN_IP
from hf_scale.planner import parallel, strategies
from hf_scale.planner.budgets import preemption_budget
from hf_scale.planner.estimate import Candidate, Estimate, Workload, estimate
from hf_scale.planner.hardware import Hardware, hardware
from hf_scale.planner.time_model import StepTime, step_time

TIE = 0.02
"""Predicted throughputs closer than this (relative) rank as equal."""
DEFAULT_SAFETY_MARGIN = 0.10
"""Fraction of GPU (and CPU) memory kept free for the CUDA context, NCCL, cuBLAS workspaces and allocator
fragmentation; the estimates are of what PyTorch allocates."""

@dataclass(frozen=True)
class Assessment:
    """A candidate's estimate, predicted time and verdict."""

    estimate: Estimate
    time: StepTime
    fits: bool
    reason: str
    """Why it does not fit ("" when it fits)."""

    @property
    def candidate(self) -> Candidate:
        return self.estimate.candidate

    @property
    def slug(self) -> str:
        """The candidate's strategy-catalogue name (hf_scale.config.presets, sizes by its sized_name rule) with ``_ac``
        when it
        runs with activation checkpointing: the plan's name for it and the default name of its generated files."""
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
    hardware: Hardware | None = None
    """The GPU profile the times are predicted on."""

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
    (auto: both): the strategy catalogue's planned entries (hf_scale.config.presets), the varied ones at each size
    hf_scale.planner.parallel allows, in the catalogue's order."""
    choices = {"on": [True], "off": [False], "auto": [False, True]}[activation_checkpointing]
    out = []
    for base in (strategies.candidate(entry.name) for entry in strategies.planned(None)):
        if base.hybrid and (w.num_machines < 2 or w.gpus_per_machine < 2):
            continue  # hybrid needs a shard group inside each machine and more than one machine
        for ac in choices:
            out.append(replace(base, activation_checkpointing=ac))
    return out + parallel.candidates(w, out)


def make_plan(
    w: Workload,
    *,
    gpu_memory: int,
    cpu_memory: int | None = None,
    activation_checkpointing: str = "auto",
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    gpu: Hardware | None = None,
) -> Plan:
    """Estimate every candidate's memory and time on ``gpu`` (default: the H100 SXM profile), order them by predicted
    tokens per second per GPU, recommend the fastest that fits."""
    gpu = gpu or hardware()
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
        assessed.append(Assessment(e, step_time(w, c, gpu), not reasons, "; ".join(reasons)))
    # Predictions within TIE of each other are a tie (the model is not that exact): the list order, less sharding and
    # fewer moving parts first, decides (stable sort).
    assessed.sort(key=lambda a: -round(math.log(a.time.tokens_per_s) / math.log1p(TIE)))
    recommended = next((a for a in assessed if a.fits), None)
    return Plan(w, gpu_memory, cpu_memory, safety_margin, tuple(assessed), recommended, hardware=gpu)


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
        if c.ep > 1:
            data["parallelism"] = {"ep": c.ep}  # FSDP2 over the world, the experts split over ep
    else:
        data["strategy"] = "deepspeed"
        data["deepspeed"] = {
            "zero_stage": c.zero_stage,
            "offload_optimizer": "cpu" if c.offload_optimizer else "none",
            "offload_params": "cpu" if c.offload_params else "none",
        }
    data["cluster"] = preemption_budget(assessment.time)  # SLURM's --signal lead and the pods' grace period
    return validate_config(data)


def planned_config_data(plan: Plan, assessment: Assessment) -> dict:
    """The fields the plan sets, as plain data for YAML or ``--set`` overrides. The global batch size is left
    to follow from micro batch x accumulation x world size, so a later topology override stays consistent."""
    data = distributed_config(plan, assessment).model_dump(mode="json", exclude_unset=True)
    data["batch"].pop("global_batch_size", None)
    return data
