"""checkpoint_layout.detect_layout on directories built in-process: what every kind of directory is said to be,
and a damaged manifest is a one-line reason, never an exception. Fast (no launches, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_scale.contract import checkpoint_layout as layout
from hf_scale.contract import checkpoint_verification
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store


def _checkpoint(root: Path, step: int, files: dict[str, str], *, state: dict | None = None, sealed=True) -> Path:
    """A checkpoint-STEP holding `files` ({relative name: content}), its state file and (sealed) its manifest."""
    path = layout.checkpoint_dir(root, step)
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    if state is not None:
        (path / layout.STATE).write_text(json.dumps(state))
    if sealed:
        store.write_manifest(path, step)
    return path


ACCELERATE = {"loop": "accelerate", "step": 2}
TRAINER = {"loop": "trainer", "step": 2}
KINDS = [
    ({"model.safetensors": "w", "optimizer.bin": "o"}, ACCELERATE, layout.FULL, None, "accelerate"),
    ({"latest": "pytorch_model\n", "pytorch_model/mp_rank_00_model_states.pt": "w"}, ACCELERATE,
     layout.DEEPSPEED, layout.DEEPSPEED_TAG, "accelerate"),
    ({"latest": "global_step2", "global_step2/x.pt": "w", "trainer_state.json": "{}"}, TRAINER,
     layout.DEEPSPEED, "global_step2", "trainer"),
    ({f"{layout.DCP_DIR}/.metadata": "m", f"{layout.DCP_DIR}/__0_0.distcp": "w"}, ACCELERATE, layout.FSDP_DCP,
     None, "accelerate"),
    ({"pytorch_model_fsdp_0/.metadata": "m"}, ACCELERATE, layout.ACCELERATE_FSDP, None, "accelerate"),
    ({"adapter_model.safetensors": "a", "adapter_config.json": "{}", "trainer_state.json": "{}"}, None,
     layout.ADAPTER_ONLY, None, "trainer"),
    ({"config.json": "{}"}, None, None, None, None),
]


@pytest.mark.parametrize(("files", "state", "weights", "tag", "loop"), KINDS,
                         ids=["full", "deepspeed", "trainer-deepspeed", "fsdp2-dcp", "accelerate-fsdp",
                              "adapter-only", "no-weights"])
def test_a_complete_checkpoint_says_where_its_weights_are_and_which_loop_wrote_it(tmp_path, files, state, weights,
                                                                                  tag, loop):
    found = layout.detect_layout(_checkpoint(tmp_path, 2, files, state=state))
    assert (found.kind, found.weights, found.deepspeed_tag, found.loop) == (layout.CHECKPOINT, weights, tag, loop)
    assert found.problem is None and "\n" not in found.describe()


def test_an_unsealed_checkpoint_is_incomplete_and_names_its_newest_complete_sibling(tmp_path):
    _checkpoint(tmp_path, 1, {"model.safetensors": "w"})
    _checkpoint(tmp_path, 2, {"model.safetensors": "w"})
    unsealed = _checkpoint(tmp_path, 3, {"model.safetensors": "w"}, sealed=False)
    found = layout.detect_layout(unsealed)
    assert (found.kind, found.weights, found.newest) == (layout.INCOMPLETE, layout.FULL, tmp_path / "checkpoint-2")
    assert found.problem == f"no {layout.MANIFEST} (an interrupted save, or not written by hf_scale)"


def test_a_file_of_another_size_than_recorded_makes_the_checkpoint_incomplete(tmp_path):
    path = _checkpoint(tmp_path, 2, {"model.safetensors": "weights"})
    (path / "model.safetensors").write_text("truncated!!")
    assert layout.detect_layout(path).problem == f"model.safetensors has 11 bytes, {layout.MANIFEST} records 7"
    (path / "model.safetensors").unlink()
    assert layout.problem(path) == f"model.safetensors is missing (listed in {layout.MANIFEST})"


@pytest.mark.parametrize("listed", [{}, {"optimizer.bin", layout.STATE}], ids=["files-empty", "weights-left-out"])
def test_a_file_the_manifest_leaves_out_makes_the_checkpoint_not_intact_for_resume_auto_and_export(tmp_path, listed):
    """A manifest edited to leave a file out (`"files": {}`, or the weights dropped) vouches for nothing about that
    file: a damaged one would load unchecked. Every reader refuses it, naming the file."""
    state = {**ACCELERATE, "world_size": 1, "strategy": "ddp", "epoch": 0, "samples_consumed_in_epoch": 2}
    _checkpoint(tmp_path, 1, {"model.safetensors": "w", "optimizer.bin": "o"}, state=state)
    path = _checkpoint(tmp_path, 2, {"model.safetensors": "w", "optimizer.bin": "o"}, state=state)
    manifest = json.loads((path / layout.MANIFEST).read_text())
    manifest["files"] = {name: entry for name, entry in manifest["files"].items() if name in listed}
    (path / layout.MANIFEST).write_text(json.dumps(manifest))
    (path / "model.safetensors").write_text("d")  # damaged, same size: only a checksum would tell
    first = "hf_scale_state.json" if not listed else "model.safetensors"
    why = f"{first} is not listed in {layout.MANIFEST}: nothing vouches for its content"
    found = layout.detect_layout(path)
    assert (found.kind, found.problem, found.newest) == (layout.INCOMPLETE, why, tmp_path / "checkpoint-1")
    assert checkpoint_verification.verify(path) == why
    # what --resume_from_checkpoint auto takes, and its messages
    assert checkpoint_verification.newest_verified(tmp_path) == (tmp_path / "checkpoint-1", [(path, why)])
    assert layout.detect_layout(tmp_path).newest == tmp_path / "checkpoint-1"
    with pytest.raises(UserError, match=f"^--resume_from_checkpoint={path}: {why}; it was left as it is"):
        store.resolve_resume(str(path), str(tmp_path), checkpoint_verification.ONE_PROCESS)
    assert _export_error(path, tmp_path).startswith(f"CHECKPOINT_DIR {path}: ")
    assert why in _export_error(path, tmp_path)


BAD_MANIFESTS = {
    "not-json": "{", "not-utf8": b"\xff\xfe", "list": "[1, 2]", "number": "42", "null": "null", "string": '"x"',
    "files-list": '{"files": ["a"]}', "files-missing": '{"step": 2}', "entry-string": '{"files": {"a": "x"}}',
    "size-bool": '{"files": {"a": {"size": true, "xxh3_128": "0"}}}', "no-hash": '{"files": {"a": {"size": 1}}}',
    "hash-number": '{"files": {"a": {"size": 1, "xxh3_128": 5}}}', "escapes": '{"files": {"../a": 1}}',
    "absolute": '{"files": {"/etc/passwd": 1}}', "empty-name": '{"files": {"": 1}}',
}


@pytest.mark.parametrize("content", BAD_MANIFESTS.values(), ids=BAD_MANIFESTS.keys())
def test_a_bad_manifest_is_a_one_line_refusal_not_an_exception(tmp_path, content):
    path = _checkpoint(tmp_path, 2, {"a": "x"}, sealed=False)
    manifest = path / layout.MANIFEST
    manifest.write_bytes(content) if isinstance(content, bytes) else manifest.write_text(content)
    found = layout.detect_layout(path)
    assert found.kind == layout.INCOMPLETE and not layout.is_complete(path)
    assert found.problem.startswith(f"{layout.MANIFEST} is unreadable (not a manifest written by hf_scale")
    assert "\n" not in found.problem
    # the resume says the same
    assert checkpoint_verification.verify(path, checkpoint_verification.ONE_PROCESS) == found.problem


def test_a_size_only_manifest_of_an_older_hf_scale_is_still_read(tmp_path):
    path = _checkpoint(tmp_path, 2, {"a": "xyz"}, sealed=False)
    (path / layout.MANIFEST).write_text(json.dumps({"step": 2, "files": {"a": 3}}))
    assert layout.read_manifest(path) == ({"a": {"size": 3}}, None)
    assert layout.detect_layout(path).kind == layout.CHECKPOINT


def test_the_manifest_written_by_seal_is_the_one_read_back(tmp_path):
    path = _checkpoint(tmp_path, 7, {"model.safetensors": "w", "sub/x.pt": "xyz"})
    entries, found = layout.read_manifest(path)
    assert found is None and sorted(entries) == ["model.safetensors", "sub/x.pt"]
    assert all(set(e) == {"size", layout.HASH_NAME} for e in entries.values())
    assert json.loads((path / layout.MANIFEST).read_text())["step"] == 7


def test_a_run_directory_names_its_newest_complete_checkpoint_and_its_final_model(tmp_path):
    for step in (2, 4):
        _checkpoint(tmp_path, step, {"model.safetensors": "w"})
    _checkpoint(tmp_path, 6, {"model.safetensors": "w"}, sealed=False)
    (tmp_path / "checkpoint-8").write_text("a file, not a checkpoint")
    layout.staging_dir(tmp_path, 8).mkdir()
    found = layout.detect_layout(tmp_path)
    assert (found.kind, found.newest, found.final_model) == (layout.RUN_DIR, tmp_path / "checkpoint-4", False)
    assert [p.name for p in found.checkpoints] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_text("w")
    assert layout.detect_layout(tmp_path).final_model


def test_a_run_directory_without_a_complete_checkpoint_has_no_newest(tmp_path):
    _checkpoint(tmp_path, 2, {"model.safetensors": "w"}, sealed=False)
    found = layout.detect_layout(tmp_path)
    assert (found.kind, found.newest) == (layout.RUN_DIR, None)


def test_a_saved_model_and_unknown_directories(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model-00001-of-00002.safetensors").write_text("w")
    assert layout.detect_layout(tmp_path / "model").kind == layout.HF_MODEL
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    assert [(f.kind, f.problem) for f in map(layout.detect_layout, [tmp_path / "nope", tmp_path / "file"])] == [
        (layout.UNKNOWN, "no such directory"), (layout.UNKNOWN, "not a directory")]
    assert layout.detect_layout(tmp_path / "empty").kind == layout.UNKNOWN


def test_a_directory_holding_a_manifest_is_a_checkpoint_whatever_its_name(tmp_path):
    path = tmp_path / "exported-by-hand"
    path.mkdir()
    (path / "model.safetensors").write_text("w")
    store.write_manifest(path, 3)
    assert layout.detect_layout(path).kind == layout.CHECKPOINT


def test_the_names_agree_with_the_libraries_that_write_them():
    from accelerate.utils.constants import FSDP_MODEL_NAME, MODEL_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    assert f"{PREFIX_CHECKPOINT_DIR}-" == layout.PREFIX  # the Trainer's own checkpoint-STEP
    assert layout.DEEPSPEED_TAG == MODEL_NAME  # accelerate's save_state tag under DeepSpeed
    assert layout.ACCELERATE_FSDP_PREFIX == FSDP_MODEL_NAME
    assert layout.step_of(layout.checkpoint_dir("out", 12)) == 12
    assert layout.step_of(Path("checkpoint-12.kept-1")) is None and layout.step_of(Path("checkpoint-")) is None
    assert layout.staging_dir("out", 3).name.startswith(layout.TMP_PREFIX)


def test_startup_removes_exactly_the_staging_directories(tmp_path):
    for label in (5, "universal-2", "replaced-4"):
        store.make_staging(tmp_path, label)
    kept = _checkpoint(tmp_path, 1, {"a": "x"}, sealed=False)
    users = layout.staging_dir(tmp_path, 9)  # named like hf_scale's, without its marker: the user's
    users.mkdir()
    (users / "notes").write_text("mine")
    layout.staging_dir(tmp_path, 6).mkdir()  # a save killed between its mkdir and its marker: empty, nothing lost
    assert sorted(p.name for p in store.remove_interrupted(tmp_path)) == [
        ".tmp-checkpoint-5", ".tmp-checkpoint-6", ".tmp-checkpoint-replaced-4", ".tmp-checkpoint-universal-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [users.name, kept.name]
    assert store.remove_interrupted(tmp_path, foreign_too=True) == [users]  # --overwrite_output_dir
    assert [p.name for p in tmp_path.iterdir()] == [kept.name]


# `hf-scale export` refuses through detect_layout: its one-line messages, in-process (no model is built).


def _export_error(path: Path, tmp_path: Path) -> str:
    from hf_scale.commands.export import export

    with pytest.raises(UserError) as error:
        export(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    return str(error.value)


def test_export_refuses_each_kind_that_is_not_a_complete_checkpoint_in_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert _export_error(run / "nope", tmp_path) == f"CHECKPOINT_DIR {run / 'nope'}: no such directory"
    assert _export_error(run, tmp_path) == (f"CHECKPOINT_DIR {run}: incomplete or corrupt checkpoint (no valid "
                                            f"{layout.MANIFEST}); export a complete OUTPUT_DIR/checkpoint-STEP")
    (run / "config.json").write_text("{}")
    (run / "model.safetensors").write_text("w")
    assert "a saved Hugging Face model, not a checkpoint" in _export_error(run, tmp_path)
    _checkpoint(run, 2, {"model.safetensors": "w"}, sealed=False)
    assert _export_error(run, tmp_path) == (
        f"CHECKPOINT_DIR {run}: a training output directory without a checkpoint of verified content (checkpoint-2: "
        f"no {layout.MANIFEST} (an interrupted save, or not written by hf_scale)) (its final model is already in it: "
        "from_pretrained loads that directory)")
    _checkpoint(run, 1, {"config.json": "{}"})
    assert _export_error(run / "checkpoint-2", tmp_path).endswith(
        f"the newest verified one beside it is {run / 'checkpoint-1'}")
    assert _export_error(run, tmp_path).startswith(f"CHECKPOINT_DIR {run / 'checkpoint-1'}: no model weights found")
    _checkpoint(run, 3, {"latest": "global_step9", "config.json": "{}"})
    assert _export_error(run / "checkpoint-3", tmp_path) == (
        f"CHECKPOINT_DIR {run / 'checkpoint-3'}: 'latest' names global_step9, which is not a directory in it")


def test_a_push_of_the_run_directory_leaves_out_exactly_the_training_state():
    """hf_scale.files.hub uploads OUTPUT_DIR without TRAINING_STATE_GLOBS, matched the way huggingface_hub's
    upload_folder matches them (filter_repo_objects on the files' relative paths)."""
    from huggingface_hub.utils import filter_repo_objects

    from hf_scale.train.checkpoint import output_lock
    from hf_scale.train.checkpoint.save import REPORT_FILE

    state = [f"{layout.checkpoint_name(2)}/{layout.MODEL_WEIGHTS}", f"{layout.checkpoint_name(2)}/{layout.MANIFEST}",
             f"{layout.checkpoint_name(1)}.kept-1/{layout.MODEL_WEIGHTS}", f"{layout.TMP_PREFIX}3/{layout.STATE}",
             f"{layout.TMP_PREFIX}universal-2/x", output_lock.LOCK_FILE]
    model = [layout.MODEL_CONFIG, layout.MODEL_WEIGHTS, "tokenizer.json", REPORT_FILE, "train_summary.json",
             "metrics.jsonl"]
    kept = list(filter_repo_objects([*state, *model], ignore_patterns=list(layout.TRAINING_STATE_GLOBS)))
    assert kept == model
