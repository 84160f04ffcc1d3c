"""The published training runs of hf_scale/planner/data/published_runs.yaml and the time model's prediction of each:
the accuracy tests/planner/test_planner_time.py holds and benchmarks/planner_time_accuracy.py prints, in sample (the
data file's efficiencies, which are :func:`fit` of every row) and held out (:func:`leave_one_source_out`)."""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from hf_scale.knowledge.model_shapes import ModelShapes
from hf_scale.planner import strategies
from hf_scale.planner.estimate import Candidate, Workload
from hf_scale.planner.hardware import Hardware, architecture, efficiency_architecture, hardware
from hf_scale.planner.time_model import step_time

DATA = Path(__file__).with_name("data") / "published_runs.yaml"
LAYOUTS = {
    "fsdp_full_shard": Candidate("fsdp2_full_shard", "FSDP2 full shard", "fsdp"),
    "hsdp": Candidate("fsdp2_hybrid_multinode", "FSDP2 hybrid shard", "fsdp", hybrid=True),
    "zero2": Candidate("zero2", "ZeRO-2", "deepspeed", zero_stage=2),
    "zero3": Candidate("zero3", "ZeRO-3", "deepspeed", zero_stage=3),
}
"""The layouts the rows use, as the planner's candidates (a row's tp/cp degrees are set on them)."""
GEMM_GRID = tuple(round(0.40 + 0.025 * i, 3) for i in range(19))
ATTENTION_GRID = tuple(round(0.10 + 0.025 * i, 3) for i in range(17))
"""The efficiencies :func:`fit` tries: large-GEMM share of the peak 0.40-0.85, flash attention's 0.10-0.50."""
Efficiency = dict[str, tuple[float, float]]
"""(gemm, attention) efficiency per architecture."""


@dataclass(frozen=True)
class Comparison:
    row: dict
    predicted: float
    """Predicted tokens/s per GPU."""

    @property
    def published(self) -> float:
        return float(self.row["tokens_per_s_per_gpu"])

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return self.predicted / self.published - 1


@functools.cache
def _data() -> dict:
    return yaml.safe_load(DATA.read_text())


@functools.cache
def shapes(name: str) -> ModelShapes:
    """A Llama-style model from the table's dimensions (no config.json: the rows name models by their shapes)."""
    m = _data()["models"][name]
    d, head_dim = m["hidden"], m["hidden"] // m["heads"]
    layer = d * head_dim * (2 * m["heads"] + 2 * m["kv_heads"]) + 3 * d * m["intermediate"] + 2 * d
    embedding = m["vocab"] * d
    numels = (embedding, *(layer,) * m["layers"], d, *(() if m["tied"] else (embedding,)))
    linear = (layer - 2 * d) * m["layers"]
    # LoRA on every linear of a layer (q, k, v, o, gate, up, down): r x (in + out) each
    lora = m["layers"] * (7 * d + 2 * (m["heads"] + m["kv_heads"]) * head_dim + 3 * m["intermediate"])
    return ModelShapes(
        name=name,
        model_type="llama",
        decoder_layer_class="LlamaDecoderLayer",
        num_layers=m["layers"],
        hidden_size=d,
        intermediate_size=m["intermediate"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        head_dim=head_dim,
        vocab_size=m["vocab"],
        tie_word_embeddings=m["tied"],
        param_numels=numels,
        decoder_layer_params=layer,
        largest_layer_params=embedding,
        lora_params_per_rank=lora,
        linear_params=linear,
    )


@functools.cache
def _included() -> tuple[int, ...]:
    """Indices (in the data file) of the rows the accuracy is measured on: all but those with an ``excluded`` reason."""
    return tuple(i for i, r in enumerate(_data()["runs"]) if not r.get("excluded"))


def rows() -> list[dict]:
    """The rows the accuracy is measured on (fitted and held out); :func:`excluded` has the others."""
    return [_data()["runs"][i] for i in _included()]


def excluded() -> list[Comparison]:
    """The rows kept out of the fit and of both accuracies (each with its ``excluded`` reason, docs/plan.md), predicted
    on the data file's efficiencies: shown, never counted."""
    left_out = [i for i in range(len(_data()["runs"])) if i not in _included()]
    return [_predict(i, None) for i in left_out]


def fitted_as(index: int) -> str:
    """The architecture whose efficiencies predict row ``index`` and which it is fitted into: its GPU's, or the one
    hardware.yaml assumes that architecture is like (Ada: Ampere), so that such rows check the assumption."""
    return efficiency_architecture(architecture(rows()[index]["gpu"]))


@functools.cache
def _gpu(name: str, efficiency: tuple[float, float] | None) -> Hardware:
    hw = hardware(name)
    if efficiency is None:
        return hw
    return replace(hw, gemm_efficiency=efficiency[0], attention_efficiency=efficiency[1])


@functools.cache
def _inputs(index: int) -> tuple[Workload, Candidate, dict]:
    """The workload, layout and step_time options of the data file's row ``index`` (built once: :func:`fit` predicts
    each row hundreds of times)."""
    row = _data()["runs"][index]
    gpus = int(row["gpus"])
    w = Workload(
        shapes=shapes(row["model"]),
        gpus_per_machine=min(gpus, 8),
        num_machines=max(gpus // 8, 1),
        seq_len=int(row["seq_len"]),
        micro_batch_size=int(row["micro_batch"]),
        lora_r=row.get("lora_r"),
        load_in_4bit=bool(row.get("qlora", False)),
    )
    # named as the strategy catalogue names the setup at these degrees (fsdp2_tp4, ...)
    layout = replace(LAYOUTS[row["layout"]], tp=int(row.get("tp", 1)), cp=int(row.get("cp", 1)),
                     offload_params=bool(row.get("offload_params", False)))
    c = strategies.named(layout)
    options = dict(
        recompute=row["recompute"],
        micro_steps=int(row["micro_steps"]),
        compiled=bool(row.get("compile", False)),
        fp8=bool(row.get("fp8", False)),
        fp8_all_gather=bool(row.get("fp8_all_gather", False)),
    )
    return w, c, options


def compare(runs: list[int] | None = None, efficiency: Efficiency | None = None) -> list[Comparison]:
    """Every row (or the rows at the indices ``runs``) with the time model's prediction, on the data file's
    efficiencies or ``efficiency``."""
    out = []
    for i in range(len(rows())) if runs is None else runs:
        out.append(_predict(_included()[i], None if efficiency is None else efficiency[fitted_as(i)]))
    return out


def _predict(index: int, pair: tuple[float, float] | None) -> Comparison:
    """The data file's row ``index`` predicted on its GPU with the efficiencies ``pair`` (None: the data file's)."""
    row = _data()["runs"][index]
    w, c, options = _inputs(index)
    return Comparison(row, step_time(w, c, _gpu(row["gpu"], pair), **options).tokens_per_s)


def accuracy(comparisons: list[Comparison]) -> tuple[float, float]:
    """(median absolute relative error, share of rows within +-25%)."""
    errors = [abs(c.error) for c in comparisons]
    return statistics.median(errors), sum(e <= 0.25 for e in errors) / len(errors)


def source(name: str) -> str:
    return _data()["sources"][name]


def fit(runs: list[int]) -> Efficiency:
    """The (gemm, attention) efficiency per architecture that predicts ``runs`` best (least mean absolute log error,
    a grid search over :data:`GEMM_GRID` x :data:`ATTENTION_GRID`): what hardware.yaml's ``efficiency`` holds when
    fitted to every row, and what each fold of :func:`leave_one_source_out` is fitted to."""
    out: Efficiency = {}
    for arch in sorted({fitted_as(i) for i in runs}):
        mine = [i for i in runs if fitted_as(i) == arch]

        def loss(pair: tuple[float, float], mine=mine, arch=arch) -> float:
            return sum(abs(math.log1p(c.error)) for c in compare(mine, {arch: pair}))

        out[arch] = min(itertools.product(GEMM_GRID, ATTENTION_GRID), key=loss)
    return out


def leave_one_source_out() -> dict[str, list[Comparison]]:
    """Per source: its rows predicted with efficiencies fitted to every other source's rows (out of sample). A source
    whose GPU architecture no other source measured cannot be held out and is left out of the answer."""
    out = {}
    for name in _data()["sources"]:
        held = [i for i, r in enumerate(rows()) if r["source"] == name]
        rest = [i for i, r in enumerate(rows()) if r["source"] != name]
        efficiency = fit(rest)
        if held and all(fitted_as(i) in efficiency for i in held):
            out[name] = compare(held, efficiency)
    return out
