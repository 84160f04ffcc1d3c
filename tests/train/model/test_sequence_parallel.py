"""DeepSpeed Ulysses sequence parallelism over gloo on CPU, real processes: sp=2 on the embedded tiny Llama gives
the one-process DeepSpeed run's per-step losses and gradient norms (ulysses_sp_worker.py). train.py's manual loop
drives the same pieces through accelerate (test_sequence_parallel_train.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import child_env, run, torchrun

from hf_scale.config import parallelism
from hf_scale.train.data.embedded import build_tiny_llama
from hf_scale.train.model import sequence_parallel

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("ulysses_sp_worker.py")


def _run(model_dir: Path, output: Path, nproc: int, *worker_args) -> dict:
    result = run(torchrun(WORKER, model_dir, output, *worker_args, nproc=nproc), timeout=300, env=child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(output.read_text())


def test_ulysses_sp2_over_gloo_equals_one_process(tmp_path):
    model_dir = tmp_path / "tiny"
    build_tiny_llama(model_dir)
    one = _run(model_dir, tmp_path / "one.json", nproc=1)
    sp2 = _run(model_dir, tmp_path / "sp2.json", nproc=2)
    assert len(one["losses"]) == 4
    assert sp2["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert sp2["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    assert one["losses"][1] != pytest.approx(one["losses"][0], rel=1e-3)  # the steps really moved the model
    # train.py drives it in both loops (test_sequence_parallel_train.py).
    assert parallelism.train_refusal(parallelism.Layout(sp=2), "x", gpu_present=False) is None
    assert parallelism.node_support(gpu_present=False)["sp"]["usable"]


def test_under_zero3_the_loss_multiplier_gives_the_one_process_gradients(tmp_path):
    """ZeRO-3's reduce-scatter averages over the whole sp x data-parallel group, not only the data-parallel ranks:
    sequence_parallel.loss_multiplier multiplies by sp as well. With SGD and nothing clipped (a bound of 1000; the
    default 1.0 would normalise any scale away) the losses and DeepSpeed's own gradient norms equal one process;
    without the factor sp both were 1/2 at sp=2 (measured)."""
    model_dir = tmp_path / "tiny"
    build_tiny_llama(model_dir)
    one = _run(model_dir, tmp_path / "one.json", 1, "3", "1000")
    sp2 = _run(model_dir, tmp_path / "sp2.json", 2, "3", "1000")
    assert len(one["engine_grad_norms"]) == 4
    assert sp2["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert sp2["engine_grad_norms"] == pytest.approx(one["engine_grad_norms"], rel=1e-5)
    assert one["losses"][1] != pytest.approx(one["losses"][0], rel=1e-3)
    assert sequence_parallel.loss_multiplier(parallelism.Layout(dp_shard=2, sp=2), 3) == 4
    assert sequence_parallel.loss_multiplier(parallelism.Layout(dp_shard=2, sp=2), 2) == 2
