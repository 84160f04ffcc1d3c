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
- **Expert parallelism (FSDP2 + transformers' EP plan).** Also another ep, either way (ep=2 on 2 processes -> one
  process -> ep=2 over dp_shard=4: tests/train/model/test_model_expert_parallel.py). The experts are DTensors like
  every other parameter (`_check_ep` says what DCP writes for them), so FSDP2's resharding carries them.
- **Sequence parallelism (DeepSpeed Ulysses).** The position counts the adapter's micro-batches (each a whole
  batch of rows); the loop skips them on the loader under the adapter (`sequence_parallel.Batches.resumed`).
  Another sp, data-parallel size or micro batch takes it up where it is a prefix of the epoch's order
  (`_check_sp`); the ZeRO state does not depend on sp; another world size is refused.
- **RNG.** Every rank that existed before gets its own generator states back; a rank that did not
  keeps its seeded generators.

Refused before training starts, with what to do instead: the Trainer path at another world size (the
Trainer skips whole steps of the new run's batches, so its data position would be wrong, and it loads
DeepSpeed partitions rigidly), at another ep, or with sp > 1 on either side, an sp position inside an adapter round
at another layout, and a checkpoint of another loop or strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from hf_scale.contract import checkpoint_verification
from hf_scale.contract.checkpoint_layout import DEEPSPEED_LATEST, DEEPSPEED_TAG, MANIFEST, staging_dir, step_of
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store
from hf_scale.train.setup.run_spec import RunSpec

_FULL_STATES = {"single": "full states (DDP / one process)", "ddp": "full states (DDP / one process)"}


def _state_layout(strategy: str, zero_stage: int | None, tp: int = 1) -> str:
    """How a strategy lays out the saved training state (what must match to resume). FSDP2 and tensor-parallel
    runs save DCP shards, which DCP reshards on load to any other mesh (tp=2 -> dp_shard=2, 4 -> 2 processes)."""
    if strategy == "fsdp" or tp > 1:
        return "DCP shards (FSDP2 / tensor parallel)"
    if strategy == "deepspeed":
        return f"DeepSpeed ZeRO-{zero_stage}"
    return _FULL_STATES.get(strategy, strategy)


def check_resumable(path: Path, spec: RunSpec) -> dict:
    """The saved `hf_scale_state.json` if this run (`spec`) can resume `path`; a one-line UserError otherwise.

    Runs before the model is built, so a refusal costs nothing.
    """
    state = checkpoint_verification.read_state(path)
    convert = (
        f"or convert it with `hf-scale export {path} EXPORT_DIR` and start a new run from it "
        "(--model_name_or_path EXPORT_DIR; the optimizer state starts fresh)"
    )
    loop = spec.loop
    saved_loop = state.get("loop", "accelerate")
    if saved_loop != loop:
        raise UserError(
            f"--resume_from_checkpoint={path}: written by --loop {saved_loop}, resumed with --loop {loop}; "
            f"the two loops keep different checkpoint layouts: resume with --loop {saved_loop}, {convert}"
        )
    _check_quantization(path, state, spec, convert)
    saved_sizes = state.get("parallelism", {})
    saved = _state_layout(state["strategy"], state.get("zero_stage"), saved_sizes.get("tp", 1))
    wanted = _state_layout(spec.strategy, spec.zero_stage, spec.layout.tp)
    if saved != wanted:
        raise UserError(
            f"--resume_from_checkpoint={path}: saved with {saved}, resumed with {wanted}; "
            f"resume with the same strategy, {convert}"
        )
    sp = max(saved_sizes.get("sp", 1), spec.layout.sp)
    if sp > 1 and loop == "trainer":
        # transformers' Trainer (_run_epoch) skips the resumed epoch's batches with accelerate's skip_first_batches
        # on its train loader, which under sp is DeepSpeed's Ulysses adapter: it has no dataset or sampler to skip
        # (AttributeError), and the count is in adapter micro-batches, sp of them per loader batch. No Trainer hook
        # reaches that call short of copying _run_epoch. The manual loop skips on the loader under the adapter
        # (sequence_parallel.Batches.resumed). A Trainer checkpoint of an sp run is refused at sp=1 too: its
        # position is in that run's steps, a prefix of the epoch's order only for some layouts (_check_sp).
        raise UserError(
            f"--resume_from_checkpoint={path}: sp={sp}: the Trainer path does not resume sequence-parallel runs "
            f"(its data skip cannot pass DeepSpeed's Ulysses adapter); train them with --loop accelerate, which "
            f"resumes them exactly, {convert}"
        )
    if state["world_size"] != spec.world_size and loop == "trainer":
        raise UserError(
            f"--resume_from_checkpoint={path}: saved by {state['world_size']} processes, resumed with "
            f"{spec.world_size}; the Trainer path resumes only at the same world size: launch "
            f"{state['world_size']} processes, train with --loop accelerate (resumes at any world size), {convert}"
        )
    _check_ep(path, state, spec, convert)
    if sp > 1:
        _check_sp(path, state, spec, sp, convert)
    return state


def _check_ep(path: Path, state: dict, spec: RunSpec, convert: str) -> None:
    """Refuse (one line) the Trainer path resuming an expert-parallel checkpoint at another ep; the manual loop resumes
    at any ep and world size.

    transformers' EP plan leaves each layer's fused experts (`experts.gate_up_proj`, `experts.down_proj`: [experts,
    ...]) as DTensors on its (efsdp, ep) mesh, placements (_StridedShard(0), Shard(0)): each rank holds whole experts.
    DCP (fsdp.save_sharded, get_state_dict) writes them, and their Adam moments, as one tensor of the global shape
    whose chunks are the ranks' experts at their global offsets (observed in the .metadata: ep=2 over dp_shard=2 and
    4, ep=4, ep=2 x tp=2; loaded whole by one process, every tensor equal to the model's), and loads those chunks
    into whatever placement the new mesh gives the experts. Proven end to end in the manual loop (ep=2 on 2 processes
    -> one process -> ep=2 over dp_shard=4, the steps of the uninterrupted run: tests/train/model/
    test_model_expert_parallel.py).
    The Trainer's another world size is refused before (check_resumable); its another ep at the same world size is
    not proven. A state without an ep record predates it: it is read as ep=1 and named so."""
    if spec.loop != "trainer":
        return
    sizes = state.get("parallelism", {})
    saved_ep, ep = sizes.get("ep", 1), spec.layout.ep
    if saved_ep == ep:
        return
    saved = f"ep={saved_ep}" + ("" if "ep" in sizes else " (its hf_scale_state.json predates the record of ep)")
    raise UserError(
        f"--resume_from_checkpoint={path}: saved with {saved}, resumed with ep={ep}; the Trainer path resumes "
        f"expert-parallel checkpoints only at the ep that saved them (resharding the experts is proven in the manual "
        f"loop only): resume with parallelism.ep={saved_ep}, train with --loop accelerate (resumes at another ep or "
        f"world size), {convert}"
    )


_BASES = {"4bit": "a 4-bit base (--load_in_4bit)", None: "an unquantized base"}
UNKNOWN = "unknown"
"""What `saved_quantization` returns when neither the state nor the saved config.json records the base."""


def saved_quantization(path: Path, state: dict) -> tuple[str | None, str]:
    """The base's quantization `path` was trained on ("4bit", None for an unquantized base, or UNKNOWN) and, for a
    message, where it was read when not from hf_scale_state.json ("" then). The state's record; for a checkpoint
    written before the state recorded it, the quantization_config transformers writes into the saved config.json of
    a quantized model (both covered by the checkpoint's manifest); UNKNOWN when neither is there."""
    import json

    from hf_scale.contract.checkpoint_layout import MODEL_CONFIG

    if "quantization" in state:
        return state["quantization"], ""
    try:
        config = json.loads((path / MODEL_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return UNKNOWN, ""
    found = config.get("quantization_config") if isinstance(config, dict) else None
    where = f" (read from its {MODEL_CONFIG}: its hf_scale_state.json predates the record of the quantization)"
    if not isinstance(found, dict):
        return None, where
    if found.get("quant_method") == "bitsandbytes" and (found.get("load_in_4bit") or found.get("_load_in_4bit")):
        return "4bit", where
    return str(found.get("quant_method", UNKNOWN)), where


def _check_quantization(path: Path, state: dict, spec: RunSpec, convert: str) -> None:
    """A LoRA adapter continues only on the base it was trained on: resumed on another (a QLoRA checkpoint without
    --load_in_4bit) it would train on weights it never saw, without a word. A checkpoint that records it nowhere
    (saved_quantization: UNKNOWN) is refused when it holds an adapter or this run is quantized: nothing says which
    base it continues on."""
    from hf_scale.contract.checkpoint_layout import ADAPTER_CONFIG

    saved, where = saved_quantization(path, state)
    if saved == spec.quantization:
        return
    if saved == UNKNOWN:
        if spec.quantization is None and not (path / ADAPTER_CONFIG).is_file():
            return  # a full model's weights: no base to continue on
        raise UserError(
            f"--resume_from_checkpoint={path}: records no quantization of its base (no \"quantization\" in "
            f"hf_scale_state.json, no config.json), so it cannot be told whether its adapter was trained on "
            f"{_BASES[spec.quantization]}; {convert}"
        )
    flag = "with --load_in_4bit" if saved == "4bit" else "without --load_in_4bit"
    raise UserError(
        f"--resume_from_checkpoint={path}: saved on {_BASES.get(saved, f'a {saved} base')}{where}, "
        f"resumed on {_BASES[spec.quantization]}; its adapter continues only on the base it was trained on: resume "
        f"{flag}, {convert}"
    )


def _check_sp(path: Path, state: dict, spec: RunSpec, sp: int, convert: str) -> None:
    """What the manual loop resumes when either run has sp > 1 (DeepSpeed Ulysses).

    The ZeRO state does not depend on sp: ZeRO partitions over all ranks (DeepSpeed's sequence x data-parallel
    group), so at the same world size the engine loads it as saved, at another sp too. At another world size it
    cannot: DeepSpeed's Ulysses process groups alias model parallelism to the sp group (parallel_state_sp), so the
    checkpoint records tp_degree=sp and DeepSpeed's universal converter fails ("Checkpoint model-state file count 1
    does not match pp_degree=1 * tp_degree=2", observed); and a universal load under the Ulysses groups would take
    the sp rank for a tensor-parallel rank (deepspeed.utils.bwc; not tried).

    The data position: loader batch g of an epoch goes to rank g % world, and the adapter of sp group d trains, in
    round k, the batches k x world + d x sp + j (j < sp) one after the other. A position of b micro-batches per
    rank is a prefix of the epoch's order when it ends a round (b % sp == 0) or when there is one sp group
    (dp == 1). The same layout takes up any position (it skips the same rounds and drops the same micro-batches
    of the round); another must find a prefix and skip exactly it."""
    if state["world_size"] != spec.world_size:
        raise UserError(
            f"--resume_from_checkpoint={path}: sp={sp}: saved by {state['world_size']} processes, resumed with "
            f"{spec.world_size}; DeepSpeed records the Ulysses sp group as tensor parallelism, which its "
            f"universal-checkpoint converter cannot reshard: launch {state['world_size']} processes (sp and the "
            f"micro batch may change), {convert}"
        )
    samples = state["samples_consumed_in_epoch"]
    saved_sp = state.get("parallelism", {}).get("sp", 1)  # sp excludes tp and cp (parallelism.layout_problems)
    saved = (saved_sp, state["world_size"] // saved_sp, state["micro_batch_size"])
    wanted = (spec.layout.sp, spec.data_parallel_size, spec.micro_batch_size)
    if saved == wanted:
        return

    def a_prefix(sp: int, dp: int, micro: int) -> bool:
        rows = micro * dp  # samples per adapter micro-batch on all ranks together
        return samples % rows != 0 or (samples // rows) % sp == 0 or dp == 1  # not whole: CheckpointSaver.load's

    if not (a_prefix(*saved) and a_prefix(*wanted)):
        raise UserError(
            f"--resume_from_checkpoint={path}: step {state['step']} ends inside a round of the Ulysses adapter's "
            f"micro-batches ({samples} samples into epoch {state['epoch']}), which only the layout that saved it "
            f"can take up: resume with sp={saved[0]} and --per_device_train_batch_size {saved[2]}, or from a "
            "checkpoint whose micro-batches per rank are a multiple of sp"
        )


@contextlib.contextmanager
def deepspeed_universal(path: Path, accelerator, engine, work_root: Path) -> Iterator[Path]:
    """A view of checkpoint `path` whose DeepSpeed tag is a universal checkpoint, and `engine` set to load
    it as one. Yields the directory to hand to `accelerator.load_state` (every rank)."""
    container = staging_dir(work_root, f"universal-{step_of(path)}")
    view = container / path.name
    error = None
    if accelerator.is_main_process:
        try:
            store.make_staging(work_root, f"universal-{step_of(path)}")
            _convert(path, view, accelerator.num_processes)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below, instead of a hang at the barrier
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    from accelerate.utils import broadcast_object_list

    error = broadcast_object_list([error])[0]
    if error:
        raise UserError(
            f"--resume_from_checkpoint={path}: DeepSpeed's universal-checkpoint conversion failed ({error}); "
            f"resume with {checkpoint_verification.read_state(path)['world_size']} processes"
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
