"""Resuming a checkpoint with another number of processes than the one that saved it.

The manual loop (`--loop accelerate`) resumes at any world size; every part of the state follows:

- **Data position.** `hf_scale_state.json` records the samples consumed in the epoch. An epoch's order
  is one permutation of the dataset (one seed, the same for every world size) dealt round-robin in
  micro-batches, so the new run skips `samples / (micro batch x processes)` micro-batches per rank
  and sees exactly the samples the old run had not. The global batch (micro x accumulation x
  processes) may change; when it does not (2 processes x accumulation 2 -> 1 process x
  accumulation 4) the following steps equal those of the uninterrupted run.
- **DDP / one process.** Model, optimizer and scheduler are saved whole: nothing to convert.
- **DeepSpeed ZeRO-1/2/3.** Optimizer (and under ZeRO-3 parameter) partitions belong to the ranks that
  wrote them. The main process converts the checkpoint with DeepSpeed's own universal-checkpoint
  converter (`deepspeed.checkpoint.ds_to_universal`: fp32 weights and Adam moments per parameter)
  into a temporary directory in `--output_dir`, and the engine loads it as a universal checkpoint
  (DeepSpeed's `"checkpoint": {"load_universal": true}`), re-partitioned for the new world size. The
  temporary directory is removed afterwards (or, after a crash, at the next start like any
  interrupted save).
- **FSDP2.** torch.distributed.checkpoint reshards natively on load.
- **RNG.** Every rank that existed before gets its own generator states back; a rank that did not
  keeps its seeded generators.

Refused before training starts, with what to do instead: the Trainer path at another world size (the
Trainer skips whole steps of the new run's batches, so its data position would be wrong, and it loads
DeepSpeed partitions rigidly), and a checkpoint of another loop or strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store as checkpoint
from hf_scale.train.checkpoint.layout import DEEPSPEED_LATEST, DEEPSPEED_TAG, MANIFEST, staging_dir, step_of

_FULL_STATES = {"single": "full states (DDP / one process)", "ddp": "full states (DDP / one process)"}


def _state_layout(strategy: str, zero_stage: int | None, tp: int = 1) -> str:
    """How a strategy lays out the saved training state (what must match to resume). FSDP2 and tensor-parallel
    runs save DCP shards, which DCP reshards on load to any other mesh (tp=2 -> dp_shard=2, 4 -> 2 processes)."""
    if strategy == "fsdp" or tp > 1:
        return "DCP shards (FSDP2 / tensor parallel)"
    if strategy == "deepspeed":
        return f"DeepSpeed ZeRO-{zero_stage}"
    return _FULL_STATES.get(strategy, strategy)


def check_resumable(path: Path, *, loop: str, world_size: int, strategy: str, zero_stage: int | None,
                    tp: int = 1, sp: int = 1) -> dict:
    """The saved `hf_scale_state.json` if this run can resume `path`; a one-line UserError otherwise.

    Runs before the model is built, so a refusal costs nothing.
    """
    if sp > 1:
        # DeepSpeed's Ulysses adapter turns each loader batch into sp micro-batches: neither loop can skip to the
        # saved data position through it yet (the Trainer's skip fails inside the adapter).
        raise UserError(f"--resume_from_checkpoint={path}: sp={sp}: resuming a sequence-parallel run is not "
                        "supported yet; start it again, or resume with sp=1")
    state = checkpoint.read_state(path)
    convert = (
        f"or convert it with `hf-scale export {path} EXPORT_DIR` and start a new run from it "
        "(--model_name_or_path EXPORT_DIR; the optimizer state starts fresh)"
    )
    saved_loop = state.get("loop", "accelerate")
    if saved_loop != loop:
        raise UserError(
            f"--resume_from_checkpoint={path}: written by --loop {saved_loop}, resumed with --loop {loop}; "
            f"the two loops keep different checkpoint layouts: resume with --loop {saved_loop}, {convert}"
        )
    saved = _state_layout(state["strategy"], state.get("zero_stage"), state.get("parallelism", {}).get("tp", 1))
    wanted = _state_layout(strategy, zero_stage, tp)
    if saved != wanted:
        raise UserError(
            f"--resume_from_checkpoint={path}: saved with {saved}, resumed with {wanted}; "
            f"resume with the same strategy, {convert}"
        )
    if state["world_size"] != world_size and loop == "trainer":
        raise UserError(
            f"--resume_from_checkpoint={path}: saved by {state['world_size']} processes, resumed with "
            f"{world_size}; the Trainer path resumes only at the same world size: launch "
            f"{state['world_size']} processes, train with --loop accelerate (resumes at any world size), {convert}"
        )
    return state


@contextlib.contextmanager
def deepspeed_universal(path: Path, accelerator, engine, work_root: Path) -> Iterator[Path]:
    """A view of checkpoint `path` whose DeepSpeed tag is a universal checkpoint, and `engine` set to load
    it as one. Yields the directory to hand to `accelerator.load_state` (every rank)."""
    container = staging_dir(work_root, f"universal-{step_of(path)}")
    view = container / path.name
    error = None
    if accelerator.is_main_process:
        try:
            checkpoint.make_staging(work_root, f"universal-{step_of(path)}")
            _convert(path, view, accelerator.num_processes)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below, instead of a hang at the barrier
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    from accelerate.utils import broadcast_object_list

    error = broadcast_object_list([error])[0]
    if error:
        raise UserError(
            f"--resume_from_checkpoint={path}: DeepSpeed's universal-checkpoint conversion failed ({error}); "
            f"resume with {checkpoint.read_state(path)['world_size']} processes"
        )
    # The config key "checkpoint": {"load_universal": true} becomes this attribute; DeepSpeed reads it only
    # while loading, so setting it now is the same as having it in the JSON from the start.
    config = engine._config
    config.load_universal_checkpoint = True
    try:
        yield view
    finally:
        config.load_universal_checkpoint = False
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(container, ignore_errors=True)


def _convert(path: Path, view: Path, new_world: int) -> None:
    """Main process: `view/` links every file of `path` except the DeepSpeed tag, which is converted."""
    from deepspeed.checkpoint import ds_to_universal

    view.mkdir()
    for entry in path.iterdir():
        if entry.name not in (DEEPSPEED_TAG, DEEPSPEED_LATEST, MANIFEST):
            (view / entry.name).symlink_to(entry.resolve())
    print(
        f"hf_scale: converting {path} to a DeepSpeed universal checkpoint to resume with {new_world} processes",
        file=sys.stderr,
        flush=True,
    )
    args = argparse.Namespace(
        input_folder=str(path / DEEPSPEED_TAG),
        output_folder=str(view / DEEPSPEED_TAG),
        # Serial: worker processes forked from a rank of a running process group are not safe.
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(sys.stderr):
        ds_to_universal.main(args)
