"""The published training runs of hf_scale/planner/data/published_runs.yaml and the time model's prediction of each:
the accuracy tests/planner/test_planner_time.py holds and benchmarks/planner_time_accuracy.py prints."""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from hf_scale.planner.estimate import Candidate, Workload
from hf_scale.planner.hardware import hardware
from hf_scale.planner.model_shapes import ModelShapes
from hf_scale.planner.time_model import step_time

DATA = Path(__file__).with_name("data") / "published_runs.yaml"
LAYOUTS = {"fsdp_full_shard": Candidate("fsdp2_full_shard", "FSDP2 full shard", "fsdp")}
"""The layouts the rows use, as the planner's candidates."""


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


def shapes(name: str) -> ModelShapes:
    """A Llama-style model from the table's dimensions (no config.json: the rows name models by their shapes)."""
    m = _data()["models"][name]
    d, head_dim = m["hidden"], m["hidden"] // m["heads"]
    layer = d * head_dim * (2 * m["heads"] + 2 * m["kv_heads"]) + 3 * d * m["intermediate"] + 2 * d
    embedding = m["vocab"] * d
    numels = (embedding, *(layer,) * m["layers"], d, *(() if m["tied"] else (embedding,)))
    linear = (layer - 2 * d) * m["layers"]
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
        lora_params_per_rank=0,
        linear_params=linear,
    )


def compare() -> list[Comparison]:
    """Every row with the time model's prediction."""
    out = []
    for row in _data()["runs"]:
        gpus = int(row["gpus"])
        w = Workload(
            shapes=shapes(row["model"]),
            gpus_per_machine=min(gpus, 8),
            num_machines=max(gpus // 8, 1),
            seq_len=int(row["seq_len"]),
            micro_batch_size=int(row["micro_batch"]),
        )
        t = step_time(
            w,
            LAYOUTS[row["layout"]],
            hardware(row["gpu"]),
            recompute=row["recompute"],
            micro_steps=int(row["micro_steps"]),
        )
        out.append(Comparison(row, t.tokens_per_s))
    return out


def accuracy(comparisons: list[Comparison]) -> tuple[float, float]:
    """(median absolute relative error, share of rows within +-25%)."""
    errors = [abs(c.error) for c in comparisons]
    return statistics.median(errors), sum(e <= 0.25 for e in errors) / len(errors)


def source(name: str) -> str:
    return _data()["sources"][name]
