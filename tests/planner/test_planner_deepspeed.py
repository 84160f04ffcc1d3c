"""Proof: the planner's model-state bytes per rank are, to the byte, what the real DeepSpeed engine holds on
each of 2 CPU processes (gloo) for ZeRO-1, ZeRO-2 and ZeRO-3 on the tiny Llama (fp32, torch AdamW).

tests/_planner_ds_worker.py documents exactly which tensors are summed."""

from __future__ import annotations

import json

import pytest
from paths import TESTS, TINY_LLAMA
from train_helpers import child_env, run, torchrun

from hf_scale.planner import Candidate, Workload, estimate, model_shapes

pytestmark = pytest.mark.multiprocess

WORKER = TESTS / "_planner_ds_worker.py"
TINY = TINY_LLAMA


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_states_equal_what_the_deepspeed_engine_holds_on_each_rank(stage, tmp_path):
    shapes = model_shapes(str(TINY))
    threshold = 10 * shapes.hidden_size  # what "auto" resolves to under the HF Trainer: norms stay whole
    done = run(torchrun(WORKER, stage, threshold, tmp_path), env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    workload = Workload(shapes, gpus_per_machine=2, num_machines=1, seq_len=16, micro_batch_size=1, precision="no")
    predicted = estimate(workload, Candidate(f"zero{stage}", "", "deepspeed", zero_stage=stage))
    for rank in (0, 1):
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert held["world_size"] == 2 and held["stage"] == stage
        assert not held["overlapping_categories"]
        assert held["params"] == predicted.params
        assert held["grads"] == predicted.grads
        assert held["master"] + held["optimizer"] == predicted.optimizer
        assert held["params"] + held["grads"] + held["master"] + held["optimizer"] == predicted.model_states
