"""`hf-scale plan --calibrate RUN_DIR`: the time model corrected by what a finished train.py run measured.

The run directory holds what train.py wrote (hf_scale.contract.checkpoint_layout names the files; the planner, below
train/ in the import order, spells the three it reads): `metrics.jsonl` (one record per optimizer step with its
`step_time_s` and the real `tokens` of the step over the whole job), the newest `checkpoint-STEP/hf_scale_state.json`
(world size, strategy, ZeRO stage, micro-batch, gradient accumulation, precision, the parallelism sizes, the
quantization), the model's `config.json` (the final model's, else the checkpoint's), LoRA's `adapter_config.json`
when there is one, and `hf_scale_live.json` (whether activation checkpointing really ran).

The correction is one factor on the whole predicted step: measured / predicted for that run's layout, on the plan's
hardware profile. Every term of every candidate is multiplied by it, so the next plan on that hardware predicts the
run's own layout exactly and the others in proportion. The measured step is the median `step_time_s` of the step
records after the first (which includes the warm-up); the run's sequence length is its real tokens per sequence
(tokens / global batch), what it computed on.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from hf_scale.errors import UserError
from hf_scale.files.reading import load_json, read_bytes, read_text
from hf_scale.planner import strategies
from hf_scale.planner.estimate import Candidate, Workload
from hf_scale.planner.hardware import Hardware
from hf_scale.planner.time_model import step_time

METRICS = "metrics.jsonl"
STATE = "hf_scale_state.json"
LIVE = "hf_scale_live.json"
ADAPTER = "adapter_config.json"
MAX_METRICS_BYTES = 2**30
"""metrics.jsonl read at most (a record is ~300 bytes: millions of steps)."""
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_ENGINES = {"single": "ddp", "ddp": "ddp", "deepspeed": "deepspeed", "fsdp": "fsdp"}


@dataclass(frozen=True)
class Calibration:
    """The run a correction was derived from, and the correction."""

    run_dir: str
    workload: Workload
    """The run's job: its model, world, micro-batch and tokens per sequence."""
    candidate: Candidate
    micro_steps: int
    measured_step_s: float
    predicted_step_s: float
    """Uncalibrated, on the plan's hardware profile."""
    steps: int
    """Step records the measured median is of."""

    @property
    def factor(self) -> float:
        return self.measured_step_s / self.predicted_step_s

    def apply(self, hw: Hardware) -> Hardware:
        return replace(hw, step_correction=hw.step_correction * self.factor)

    def describe(self, hw: Hardware) -> str:
        w = self.workload
        return (
            f"calibrated from {self.run_dir}: every predicted step x {self.factor:.3f} (measured "
            f"{self.measured_step_s:.4g} s/step, the median of {self.steps} step(s) of metrics.jsonl, vs "
            f"{self.predicted_step_s:.4g} s predicted on {hw.label} for its layout: {self.candidate.label}"
            + (" with activation checkpointing" if self.candidate.activation_checkpointing else "")
            + f", {w.num_machines} x {w.gpus_per_machine} GPU(s), micro-batch {w.micro_batch_size} x {w.seq_len} "
            f"tokens, {self.micro_steps} micro-batch(es) per step, {w.shapes.name})"
        )

    def as_dict(self) -> dict:
        return {
            "run_dir": self.run_dir, "factor": self.factor, "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s, "steps": self.steps, "layout": self.candidate.key,
            "activation_checkpointing": self.candidate.activation_checkpointing,
            "world_size": self.workload.world_size, "seq_len": self.workload.seq_len,
            "micro_batch_size": self.workload.micro_batch_size, "gradient_accumulation_steps": self.micro_steps,
        }


def _fail(run_dir: Path, why: str) -> UserError:
    return UserError(f"--calibrate {run_dir}: {why}")


def _json(path: Path, run_dir: Path) -> dict:
    try:
        data = load_json(read_text(path, "file"), path.name)
    except UserError as error:
        raise _fail(run_dir, f"{path.name} cannot be read ({error})") from None
    if not isinstance(data, dict):
        raise _fail(run_dir, f"{path.name} is not a JSON object")
    return data


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")


def measured_steps(run_dir: Path) -> list[dict]:
    """The step records of metrics.jsonl (evaluation records and unreadable lines left out)."""
    path = run_dir / METRICS
    if not path.exists():
        raise _fail(run_dir, f"no {METRICS}: not the output directory of a train.py run (it writes "
                    f"OUTPUT_DIR/{METRICS}, one record per optimizer step)")
    try:
        text = read_bytes(path, "file", max_bytes=MAX_METRICS_BYTES).decode(errors="replace")
    except UserError as error:
        raise _fail(run_dir, f"{METRICS} cannot be read ({error})") from None
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "loss" in record and _number(record.get("step_time_s")) \
                and _number(record.get("tokens")):
            records.append(record)
    if not records:
        raise _fail(run_dir, f"{METRICS} has no training step (a record with step_time_s and tokens): the run "
                    "stopped before its first optimizer step")
    return records


def _newest_checkpoint(run_dir: Path) -> Path:
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _CHECKPOINT.fullmatch(p.name))
             and (p / STATE).is_file()]
    if not found:
        raise _fail(run_dir, f"no checkpoint-STEP/{STATE}: the run's layout (strategy, world size, batch) cannot be "
                    "read; calibrate on a run that saved at least one checkpoint")
    return max(found, key=lambda item: item[0])[1]


def _state(checkpoint: Path, run_dir: Path) -> dict:
    state = _json(checkpoint / STATE, run_dir)
    fields = {"world_size": int, "strategy": str, "micro_batch_size": int, "gradient_accumulation_steps": int,
              "global_batch_size": int, "precision": str}
    bad = [name for name, kind in fields.items() if type(state.get(name)) is not kind
           or (kind is int and state[name] < 1)]
    if bad or state["strategy"] not in _ENGINES:
        what = ", ".join(bad) or f"strategy {state['strategy']!r} (allowed {', '.join(_ENGINES)})"
        raise _fail(run_dir, f"{checkpoint.name}/{STATE} lacks a valid {what}: the run's layout cannot be read")
    return state


def _model_config(run_dir: Path, checkpoint: Path) -> Path:
    for place in (run_dir, checkpoint):
        if (place / "config.json").is_file():
            return place / "config.json"
    raise _fail(run_dir, f"no config.json in it nor in {checkpoint.name}: the run's model cannot be read")


def _lora_r(run_dir: Path, checkpoint: Path) -> int | None:
    for place in (run_dir, checkpoint):
        if (place / ADAPTER).is_file():
            r = _json(place / ADAPTER, run_dir).get("r")
            if type(r) is not int or r < 1:
                raise _fail(run_dir, f"{ADAPTER} has no valid LoRA rank r ({r!r})")
            return r
    return None


def _activation_checkpointing(run_dir: Path) -> bool:
    """What hf_scale_live.json says ran (no file: assumed off)."""
    if not (run_dir / LIVE).is_file():
        return False
    live = _json(run_dir / LIVE, run_dir)
    fsdp = live.get("fsdp") if isinstance(live.get("fsdp"), dict) else {}
    return bool(live.get("activation_checkpointing") or fsdp.get("activation_checkpointing"))


def _candidate(state: dict, activation_checkpointing: bool) -> Candidate:
    """The planner's candidate of the run's layout (CPU offload is not recorded in the run directory: none)."""
    sizes = state.get("parallelism") if isinstance(state.get("parallelism"), dict) else {}
    tp, cp = int(sizes.get("tp", 1)), int(sizes.get("cp", 1))
    engine = _ENGINES[state["strategy"]]
    stage = int(state.get("zero_stage") or 0) if engine == "deepspeed" else 0
    hybrid = engine == "fsdp" and int(sizes.get("dp_replicate", 1)) > 1
    # named as the catalogue names the setup (a composite name where it has none, e.g. tp and cp together)
    name = "fsdp2_" + ("hybrid_" if hybrid else "") + (f"tp{tp}" if tp > 1 else "") + (f"cp{cp}" if cp > 1 else "")
    text = ("HSDP" if hybrid else "FSDP2") + (f" x TP={tp}" if tp > 1 else "") + (f" x CP={cp}" if cp > 1 else "")
    return strategies.named(Candidate(name, text, engine, zero_stage=stage, hybrid=hybrid, tp=tp, cp=cp,
                                      activation_checkpointing=activation_checkpointing))


def calibrate(run_dir: str, hw: Hardware, *, gpus_per_machine: int, optimizer: str = "adamw") -> Calibration:
    """The correction that makes the time model predict ``run_dir``'s measured step on ``hw``; a one-line UserError
    for a directory that is not a finished run whose model and layout can be read."""
    path = Path(run_dir)
    if not path.is_dir():
        raise _fail(path, "not a directory (give the --output_dir of a finished train.py run)")
    records = measured_steps(path)
    checkpoint = _newest_checkpoint(path)
    state = _state(checkpoint, path)
    from hf_scale.knowledge.model_shapes import model_shapes

    config = _model_config(path, checkpoint)
    try:
        shapes = model_shapes(str(config))
    except UserError as error:
        raise _fail(path, f"the run's model cannot be read: {error}") from None
    timed = records[1:] or records  # the first step includes the warm-up (allocations, compilation)
    tokens = statistics.median(r["tokens"] for r in timed)
    world = state["world_size"]
    per_machine = gpus_per_machine if world >= gpus_per_machine and world % gpus_per_machine == 0 else world
    lora_r = _lora_r(path, checkpoint)
    workload = Workload(
        shapes=shapes, gpus_per_machine=per_machine, num_machines=world // per_machine,
        seq_len=max(1, round(tokens / state["global_batch_size"])), micro_batch_size=state["micro_batch_size"],
        precision=state["precision"], optimizer=optimizer, lora_r=lora_r,
        load_in_4bit=lora_r is not None and state.get("quantization") == "4bit",
    )
    candidate = _candidate(state, _activation_checkpointing(path))
    micro_steps = state["gradient_accumulation_steps"]
    predicted = step_time(workload, candidate, replace(hw, step_correction=1.0), micro_steps=micro_steps).step_s
    measured = statistics.median(r["step_time_s"] for r in timed)
    return Calibration(str(path), workload, candidate, micro_steps, measured, predicted, len(timed))
