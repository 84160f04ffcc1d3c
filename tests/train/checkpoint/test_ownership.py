"""Only what hf_scale wrote is ever removed or replaced in OUTPUT_DIR (hf_scale/train/checkpoint/ownership.py): a
user's directory named like an interrupted save, a user's model files, refused in one line unless
--overwrite_output_dir."""

from __future__ import annotations

import datasets
import pytest
from train_helpers import run_in_process, tree

from hf_scale.contract import checkpoint_layout
from hf_scale.train.checkpoint import ownership, store


@pytest.fixture(autouse=True, scope="module")
def datasets_cache_in_tmp(tmp_path_factory):
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_datasets_cache"))
    yield
    datasets.config.HF_DATASETS_CACHE = saved


def _users_files(out):
    (out / ".tmp-checkpoint-9").mkdir(parents=True)
    (out / ".tmp-checkpoint-9" / "draft.txt").write_text("mine")
    (out / "config.json").write_text('{"mine": true}')
    (out / "model.safetensors").write_bytes(b"my weights")
    (out / "notes.txt").write_text("never replaced by a run: no run writes this name")


def test_what_a_run_would_replace_is_foreign_unless_hf_scale_marked_it(tmp_path):
    _users_files(tmp_path)
    store.make_staging(tmp_path, 5)  # an interrupted save of hf_scale's
    (tmp_path / ".tmp-checkpoint-6").mkdir()  # one killed before its marker was written: empty, nothing to lose
    assert ownership.foreign(tmp_path) == [".tmp-checkpoint-9", "config.json", "model.safetensors"]
    (tmp_path / checkpoint_layout.MARKER).write_text("")  # a directory hf_scale writes: its files are its own
    assert ownership.foreign(tmp_path) == [".tmp-checkpoint-9"]  # a temporary without the marker never is
    assert ownership.foreign(tmp_path / "missing") == []


@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_a_users_files_are_refused_in_one_line_and_replaced_only_with_overwrite_output_dir(loop, tmp_path, capfd):
    """Both loops: the refusal comes before either builds anything (ownership.claim, in prepare)."""
    out = tmp_path / "out"
    _users_files(out)
    before = tree(out)
    argv = ["--max_steps", "1", "--save_steps", "1", "--loop", loop, "--output_dir", str(out)]
    capfd.readouterr()
    assert run_in_process(argv) == 2
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("train.py: error:")]
    assert line == (f"train.py: error: --output_dir={out}: holds .tmp-checkpoint-9, config.json, model.safetensors, "
                    f"not written by hf_scale (no {checkpoint_layout.MARKER}), which this run would replace or "
                    "remove; choose another --output_dir, move them away, or pass --overwrite_output_dir to let "
                    "this run replace them")
    assert tree(out) == before  # nothing removed, replaced or added

    assert run_in_process([*argv, "--overwrite_output_dir"]) == 0
    assert f"removed interrupted save {out / '.tmp-checkpoint-9'}" in capfd.readouterr().err
    assert not (out / ".tmp-checkpoint-9").exists()
    assert (out / "model.safetensors").read_bytes() != b"my weights" and (out / checkpoint_layout.MARKER).is_file()
    assert (out / "notes.txt").read_text() == before["notes.txt"].decode()
    # From now on the directory is hf_scale's: the next run replaces its own files without the flag.
    assert run_in_process(argv) == 0
    assert [p.name for p in checkpoint_layout.complete_checkpoints(out)] == ["checkpoint-1"]
