"""The Trainer's end of training (`_finalize_training`) under `--save_total_limit 1 --load_best_model_at_end`:
transformers deletes every `checkpoint-*` but the best; hf_scale's Publisher does it instead, deleting only the
checkpoints whose content verifies. A real one-process Trainer run, in this process."""

from __future__ import annotations

import datasets
import pytest
from train_helpers import run_in_process, tree

from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.train.checkpoint import store


@pytest.fixture(autouse=True, scope="module")
def datasets_cache_in_tmp(tmp_path_factory):
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_datasets_cache"))
    yield
    datasets.config.HF_DATASETS_CACHE = saved


def _damaged(output_dir, name: str):
    """A checkpoint sealed the way the savers seal one, then one bit of it flipped (the sizes still match)."""
    final = output_dir / name
    final.mkdir()
    (final / checkpoint_layout.MODEL_WEIGHTS).write_bytes(b"an earlier run's weights")
    store.write_manifest(final, 7)
    data = bytearray((final / checkpoint_layout.MODEL_WEIGHTS).read_bytes())
    data[3] ^= 0x01
    (final / checkpoint_layout.MODEL_WEIGHTS).write_bytes(bytes(data))
    assert checkpoint_layout.is_complete(final) and checkpoint_verification.verify(final) is not None
    return final


def test_the_end_of_training_deletes_only_verified_checkpoints_of_its_own(tmp_path, capfd):
    out = tmp_path / "out"
    out.mkdir()
    foreign = out / "checkpoint-99"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"another tool's")
    damaged = _damaged(out, "checkpoint-7")
    kept = _damaged(out, "checkpoint-2.kept-1")  # moved aside by an earlier run: named like the Trainer's glob
    before = {path: tree(path) for path in (foreign, damaged, kept)}

    assert run_in_process(["--loop", "trainer", "--max_steps", "3", "--save_steps", "1", "--eval_strategy", "steps",
                           "--eval_steps", "1", "--validation_split_percentage", "20", "--load_best_model_at_end",
                           "--save_total_limit", "1", "--output_dir", str(out)]) == 0

    left = [line for line in capfd.readouterr().err.splitlines()
                     if "is left in place beyond --save_total_limit" in line]
    survivors = sorted(p.name for p in out.iterdir() if p.name.startswith(checkpoint_layout.PREFIX))
    ours = [name for name in survivors if name not in ("checkpoint-99", "checkpoint-7", "checkpoint-2.kept-1")]
    assert len(ours) == 1, survivors  # the best one: every other checkpoint of this run was deleted
    assert checkpoint_verification.verify(out / ours[0]) is None
    assert {path: tree(path) for path in (foreign, damaged, kept)} == before  # untouched, byte for byte
    assert any(str(damaged) in line for line in left)
