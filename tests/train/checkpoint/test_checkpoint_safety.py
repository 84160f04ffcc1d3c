"""What train.py never does to an output directory: delete what it did not write, share it with a live run,
resume from damaged files, save a diverged model, lose metrics history on a resume.

Most runs here are one-process runs inside this process (`run_in_process`); the two 2-process launches
prove that every rank agrees (a lock refusal, a diverged step).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
from train_helpers import (
    TRAIN_PY,
    child_env,
    launcher_command,
    read_metrics,
    run,
    run_in_process,
    tree,
)

from hf_scale.contract import checkpoint_integrity, checkpoint_layout, checkpoint_verification
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import output_lock, store
from hf_scale.train.loops.metrics import continue_metrics_file

ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)
DIVERGING = ["--optim", "sgd", "--learning_rate", "10", "--max_grad_norm", "0", "--lr_scheduler_type", "constant",
             "--warmup_ratio", "0", "--save_steps", "1", "--max_steps", "8"]
"""Plain SGD at the largest allowed rate, unclipped: the tiny model's gradient norm overflows within 8 steps."""


@pytest.fixture(autouse=True, scope="module")
def datasets_cache_in_tmp(tmp_path_factory):
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_datasets_cache"))
    yield
    datasets.config.HF_DATASETS_CACHE = saved


@pytest.fixture(scope="module")
def two_step_runs(tmp_path_factory):
    """OUTPUT_DIR of a 2-step run of each loop saving checkpoint-1 and checkpoint-2 (made once, on first use)."""
    made = {}

    class Runs:
        def __getitem__(self, loop: str) -> Path:
            if loop not in made:
                out = tmp_path_factory.mktemp(f"two-steps-{loop}")
                assert run_in_process(["--max_steps", "2", "--save_steps", "1", "--loop", loop,
                                       "--output_dir", str(out)]) == 0
                made[loop] = out
            return made[loop]

    return Runs()


def _steps(output_dir: Path) -> list[int]:
    return [record["step"] for record in read_metrics(output_dir)]


def _error_lines(stderr: str, *, launcher: bool = False) -> list[str]:
    if launcher:
        # torchrun reports a failed worker with a traceback of its own (the workers must have none), and the
        # ranks share one stderr: a line may start after another rank's unfinished progress bar.
        assert not [line for line in stderr.splitlines() if 'File "' in line and "hf_scale" in line], stderr[-4000:]
        return re.findall(r"train\.py: error: [^\n]*", stderr)
    assert "Traceback" not in stderr, stderr[-4000:]
    return [line for line in stderr.splitlines() if line.startswith("train.py: error:")]


# --- pure parts ------------------------------------------------------------------------------------------


def test_hashing_is_shared_in_shares_of_about_equal_bytes():
    sizes = {f"zero_pp_rank_{r}_optim_states.pt": 1000 + r for r in range(8)} | {"config.json": 3, "latest": 1}
    parts = checkpoint_integrity.shares(sizes, 4)
    assert sorted(name for part in parts for name in part) == sorted(sizes)
    loads = [sum(sizes[name] for name in part) for part in parts]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert checkpoint_integrity.shares(sizes, 4) == parts  # every rank computes the same split


def test_a_resumed_run_keeps_the_history_up_to_its_checkpoint_and_drops_what_came_after(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 8)]
    path.write_text("\n".join(lines) + '\n{"step": 8, "lo')  # the crash cut the last line short
    with continue_metrics_file(path, 4) as handle:
        handle.write(json.dumps({"step": 5, "loss": 0.0}) + "\n")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert path.read_text().splitlines()[:4] == lines[:4]
    with continue_metrics_file(path, 0):  # a fresh run starts the file anew
        pass
    assert path.read_text() == ""


def _sealed(output_dir: Path, step: int, content: bytes) -> Path:
    """A checkpoint written and sealed the way the savers do, in its staging directory."""
    written = checkpoint_layout.checkpoint_dir(store.make_staging(output_dir, step), step)
    written.mkdir()
    (written / "model.safetensors").write_bytes(content)
    store.seal(written, step, ONE_PROCESS)
    return written


def _flip_a_bit(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum tells
    file.write_bytes(bytes(data))


def test_publishing_over_a_foreign_directory_moves_it_aside_intact(tmp_path, capfd):
    foreign = tmp_path / "checkpoint-3"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"someone else's")
    store.Publisher(tmp_path, ONE_PROCESS).publish(_sealed(tmp_path, 3, b"ours"), 3)
    assert (tmp_path / "checkpoint-3.kept-1" / "weights.bin").read_bytes() == b"someone else's"
    assert "not a checkpoint of verified content (no hf_scale_complete.json" in capfd.readouterr().err
    assert checkpoint_verification.verify(tmp_path / "checkpoint-3", ONE_PROCESS) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-3.kept-1"]  # no staging left


@pytest.mark.parametrize("damage", ["one bit flipped", "size-only manifest"])
def test_a_checkpoint_whose_content_does_not_verify_is_never_replaced_nor_rotated_away(damage, tmp_path, capfd):
    publisher = store.Publisher(tmp_path, ONE_PROCESS)
    old = store.Publisher(tmp_path, ONE_PROCESS).publish(_sealed(tmp_path, 3, b"an earlier run's"), 3)
    if damage == "one bit flipped":
        _flip_a_bit(old / "model.safetensors")
    else:  # edited to an older hf_scale's form: sizes only, which a changed byte keeps
        manifest = json.loads((old / checkpoint_layout.MANIFEST).read_text())
        manifest["files"] = {name: entry["size"] for name, entry in manifest["files"].items()}
        (old / checkpoint_layout.MANIFEST).write_text(json.dumps(manifest))
        _flip_a_bit(old / "model.safetensors")
    assert checkpoint_layout.is_complete(old)  # by sizes; but not verified content:
    found = checkpoint_verification.verify(old, ONE_PROCESS)
    assert found == ("model.safetensors is corrupt (its xxh3_128 checksum differs from the one in "
                     "hf_scale_complete.json)" if damage == "one bit flipped" else
                     "hf_scale_complete.json records no xxh3_128 checksum for model.safetensors (a size-only "
                     "manifest); its content cannot be verified")
    damaged = tree(old)
    publisher.publish(_sealed(tmp_path, 3, b"this run's"), 3)  # the same step saved again: moved aside
    assert tree(tmp_path / "checkpoint-3.kept-1") == damaged
    assert f"moved it to {tmp_path / 'checkpoint-3.kept-1'} (nothing deleted)" in capfd.readouterr().err
    # Beyond --save_total_limit: a damaged older checkpoint stays (said once), an intact one of this run goes.
    shutil.move(tmp_path / "checkpoint-3.kept-1", tmp_path / "checkpoint-1")
    for step in (4, 5):
        publisher.publish(_sealed(tmp_path, step, b"this run's"), step)
        publisher.rotate(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-5"]
    assert tree(tmp_path / "checkpoint-1") == damaged
    assert capfd.readouterr().err.count(f"{tmp_path / 'checkpoint-1'} is left in place beyond --save_total_limit: "
                                        f"{found}") == 1


def test_the_lock_names_its_holder_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "a" / "b"
    first = output_lock.OutputDirLock(out)
    first.acquire()
    with pytest.raises(UserError, match=rf"another run is using it \(pid {os.getpid()} on "):
        output_lock.OutputDirLock(out).acquire()
    first.release()
    assert not (tmp_path / "a").exists()  # created for the run, empty again: removed
    second = output_lock.OutputDirLock(tmp_path)
    second.acquire()
    second.release()
    assert tmp_path.is_dir() and not (tmp_path / output_lock.LOCK_FILE).exists()


def _lock_holder(directory: Path) -> subprocess.Popen:
    """A real process holding `directory`'s lock (as a live train.py would) until it is killed."""
    code = ("import sys, time; from hf_scale.train.checkpoint.output_lock import OutputDirLock; "
            "OutputDirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory)], env=child_env(),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_run_killed_with_sigkill_does_not_block_the_next(tmp_path):
    holder = _lock_holder(tmp_path)
    with pytest.raises(UserError, match=f"pid {holder.pid} "):
        output_lock.OutputDirLock(tmp_path).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / output_lock.LOCK_FILE).exists()  # left behind, but no longer locked
    lock = output_lock.OutputDirLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / output_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


# --- one-process runs --------------------------------------------------------------------------------------


def test_startup_removes_only_hf_scales_own_temporary_directories(tmp_path, capfd):
    out = tmp_path / "out"
    for label in (5, "universal-2"):
        staging = store.make_staging(out, label)
        (staging / "pytorch_model").mkdir(parents=True)
        (staging / "pytorch_model" / "shard.pt").write_bytes(b"partial")
    (out / "checkpoint-7").mkdir()  # another tool's checkpoint (no hf_scale manifest)
    (out / "checkpoint-7" / "optimizer.pt").write_bytes(b"theirs")
    (out / "notes.txt").write_text("mine")
    foreign = {name: tree(out / name) for name in ("checkpoint-7", "notes.txt")}
    assert run_in_process(["--max_steps", "1", "--save_steps", "1", "--loop", "accelerate",
                           "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) == 0
    stderr = capfd.readouterr().err
    assert f"removed interrupted save {out / (checkpoint_layout.TMP_PREFIX + '5')}" in stderr
    assert f"skipping {out / 'checkpoint-7'}: no {checkpoint_layout.MANIFEST}" in stderr
    assert not list(out.glob(f"{checkpoint_layout.TMP_PREFIX}*"))
    assert {name: tree(out / name) for name in foreign} == foreign
    assert [p.name for p in checkpoint_layout.complete_checkpoints(out)] == ["checkpoint-1"]


@pytest.mark.parametrize(("loop", "damage"), [("accelerate", "truncated"), ("trainer", "one bit flipped")])
def test_auto_skips_a_damaged_checkpoint_and_continues_the_metrics(loop, damage, two_step_runs, tmp_path, capfd):
    out = tmp_path / "out"
    shutil.copytree(two_step_runs[loop], out)
    damaged = out / "checkpoint-2"
    victim = next(f for f in sorted(damaged.iterdir()) if f.name.startswith("optimizer"))
    data = bytearray(victim.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01  # same size: only the checksum tells
    victim.write_bytes(bytes(data))
    damaged_files = tree(damaged)
    history = read_metrics(out)[:1]

    assert run_in_process(["--max_steps", "3", "--save_steps", "1", "--loop", loop, "--output_dir", str(out),
                           "--resume_from_checkpoint", "auto"]) == 0
    stderr = capfd.readouterr().err
    reason = f"{victim.name} has {len(data)} bytes" if damage == "truncated" else f"{victim.name} is corrupt"
    assert f"skipping {damaged}: {reason}" in stderr
    assert f"resuming from {out / 'checkpoint-1'}" in stderr
    # Not verified content (also when only the checksum tells): the new checkpoint-2 never replaces it.
    assert f"moved it to {out / 'checkpoint-2.kept-1'} (nothing deleted)" in stderr
    assert tree(out / "checkpoint-2.kept-1") == damaged_files
    saved = checkpoint_layout.complete_checkpoints(out)
    assert [p.name for p in saved] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert all(checkpoint_verification.verify(p, ONE_PROCESS) is None for p in saved)
    assert _steps(out) == [1, 2, 3]  # each step once; the history before the resume kept as it was
    assert read_metrics(out)[:1] == history


@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_a_diverging_run_stops_at_the_first_non_finite_step_before_saving_it(loop, tmp_path, capfd):
    out = tmp_path / "out"
    assert run_in_process(DIVERGING + ["--loop", loop, "--output_dir", str(out)]) == 2
    (line,) = _error_lines(capfd.readouterr().err)
    records = read_metrics(out)
    step = records[-1]["step"]
    assert f"train.py: error: step {step}: " in line and ("nan" in line or "inf" in line)
    assert all(map(_finite, (r["loss"] for r in records[:-1])))
    assert [p.name for p in checkpoint_layout.complete_checkpoints(out)] == [f"checkpoint-{s}" for s in range(1, step)]
    assert f"the newest intact checkpoint is {out / f'checkpoint-{step - 1}'}" in line
    assert not list(out.glob(f"*checkpoint-{step}*")) and not (out / "model.safetensors").exists()


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_a_full_disk_during_a_save_is_one_line_naming_the_intact_checkpoint(loop, two_step_runs, tmp_path, capfd):
    out = tmp_path / "out"
    shutil.copytree(two_step_runs[loop], out)
    shutil.rmtree(out / "checkpoint-2")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    # The optimizer state (~0.9 MB) no longer fits in a file; the tokenized data and the model (0.4 MB) do.
    resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, hard))
    try:
        code = run_in_process(["--max_steps", "2", "--save_steps", "1", "--loop", loop, "--output_dir", str(out),
                               "--resume_from_checkpoint", "auto"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    (line,) = _error_lines(capfd.readouterr().err)
    assert code == 2
    assert "saving checkpoint-2 failed (" in line
    assert f"the newest intact checkpoint is {out / 'checkpoint-1'}" in line and "GiB free" in line
    assert not (out / "checkpoint-2").exists()
    # What the failed save left is hf_scale's own temporary directory: the next start removes it and resumes.
    assert list(out.glob(f"{checkpoint_layout.TMP_PREFIX}2*"))
    assert run_in_process(["--max_steps", "2", "--save_steps", "1", "--loop", loop, "--output_dir", str(out),
                           "--resume_from_checkpoint", "auto"]) == 0
    assert "removed interrupted save" in capfd.readouterr().err
    assert _steps(out) == [1, 2]


def test_a_sharded_save_that_cannot_write_is_one_line_not_a_checkpoint_exception(tmp_path):
    """torch.distributed.checkpoint gathers the ranks' write failures into a CheckpointException, a BaseException
    (one process here; tests/train/model/test_parallelize.py has the ranks): a real file size limit makes the write
    fail, and the save's one line names the failing rank and the intact checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(UserError) as refused, store.write_errors_reported("checkpoint-2", tmp_path):
            dcp.save({"weight": torch.zeros(100_000)}, checkpoint_id=str(tmp_path / "shards"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    line = str(refused.value)
    assert line.startswith("saving checkpoint-2 failed (rank 0: ") and "\n" not in line
    assert f"there is no intact checkpoint (of verified content) in {tmp_path}" in line and "GiB free" in line


def test_two_runs_in_one_output_dir_the_second_is_refused_the_first_finishes_untouched(tmp_path, capfd):
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, TRAIN_PY, "--max_steps", "12", "--save_steps", "4", "--loop",
                              "accelerate", "--output_dir", str(out)], env=child_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        capfd.readouterr()
        assert run_in_process(["--max_steps", "2", "--loop", "accelerate", "--output_dir", str(out)]) == 2
        (line,) = _error_lines(capfd.readouterr().err)
        assert f"--output_dir={out}: another run is using it (pid {first.pid} on " in line
        _, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr[-3000:]
    assert _steps(out) == list(range(1, 13))
    saved = checkpoint_layout.complete_checkpoints(out)
    assert [p.name for p in saved] == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    assert not (out / output_lock.LOCK_FILE).exists()


# --- two processes: every rank agrees ----------------------------------------------------------------------


@pytest.mark.multiprocess
def test_every_rank_stops_on_a_lock_held_by_another_run(tmp_path):
    holder = _lock_holder(tmp_path)
    try:
        result = run(launcher_command("torchrun") + ["--max_steps", "1", "--output_dir", str(tmp_path)], timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode != 0
    # Each rank refuses on its own: both lines, unless torchrun's SIGTERM (it stops the peers of the first worker
    # that fails) reaches the slower rank first, as it does on a loaded machine; either way no rank trains or writes.
    lines = _error_lines(result.stderr, launcher=True)
    assert 1 <= len(lines) <= 2 and all(f"another run is using it (pid {holder.pid} " in line for line in lines)
    assert "exitcode  : 2" in result.stderr and "exitcode  : 0" not in result.stderr
    assert "step" not in result.stdout
    assert set(os.listdir(tmp_path)) == {output_lock.LOCK_FILE}


@pytest.mark.multiprocess
def test_every_rank_stops_at_the_first_non_finite_step_of_a_ddp_run(tmp_path):
    out = tmp_path / "out"
    # 2 x micro 4: the global batch of the one-process runs above, which diverge within 8 steps.
    result = run(launcher_command("torchrun") + DIVERGING + ["--per_device_train_batch_size", "4",
                                                             "--output_dir", str(out)], timeout=400)
    assert result.returncode != 0
    lines = _error_lines(result.stderr, launcher=True)
    step = read_metrics(out)[-1]["step"]
    assert len(lines) == 2 and all(f"step {step}: " in line for line in lines), result.stderr[-3000:]
    assert [p.name for p in checkpoint_layout.complete_checkpoints(out)] == [f"checkpoint-{s}" for s in range(1, step)]
    assert not list(out.glob(f"*checkpoint-{step}*"))


def test_checksums_are_in_every_manifest_of_both_loops(two_step_runs):
    for loop in ("accelerate", "trainer"):
        manifest = json.loads((two_step_runs[loop] / "checkpoint-2" / checkpoint_layout.MANIFEST).read_text())
        assert manifest["files"]
        assert all(checkpoint_integrity.HASH_NAME in entry for entry in manifest["files"].values())
        assert checkpoint_verification.verify(two_step_runs[loop] / "checkpoint-2", ONE_PROCESS) is None
        # Both savers write hf_scale_state.json from the run spec (one process, train.py's default batch flags).
        state = checkpoint_verification.read_state(two_step_runs[loop] / "checkpoint-2")
        assert {k: state[k] for k in ("step", "loop", "world_size", "micro_batch_size", "gradient_accumulation_steps",
                                      "global_batch_size", "precision", "seed", "data_seed")} == {
            "step": 2, "loop": loop, "world_size": 1, "micro_batch_size": 8, "gradient_accumulation_steps": 1,
            "global_batch_size": 8, "precision": "no", "seed": 42, "data_seed": 42}
