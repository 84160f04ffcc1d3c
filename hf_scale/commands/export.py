"""`hf-scale export CHECKPOINT_DIR OUT_DIR`: a training checkpoint -> a Hugging Face model directory.

Reads any complete `checkpoint-STEP` train.py writes — DeepSpeed ZeRO-1/2/3 partitions (both loops),
FSDP2 shards (torch.distributed.checkpoint), the FSDP1/FSDP2 files of accelerate's plugin on GPUs
(`pytorch_model_fsdp_0/` shards, `pytorch_model_fsdp.bin`), the plain DDP / one-process `model.safetensors`
— and writes config, sharded safetensors with their index (`save_pretrained(max_shard_size=...)`), tokenizer and
generation config, loadable by `from_pretrained` without DeepSpeed. LoRA checkpoints export the adapter
or the merged model.

Memory: the model is built on the meta device and every tensor is put in place one at a time, read
lazily from the shards (DeepSpeed's `zero_to_fp32` lazy mode, DCP reads of a few tensors at a time,
safetensors' `safe_open`, a memory-mapped `torch.load`), so one full copy of the weights is held, in the
output dtype. (ZeRO-1/2 is the exception DeepSpeed imposes: its consolidation concatenates the fp32
partitions first, so a 16-bit export of a ZeRO-1/2 checkpoint holds that fp32 copy too.) The result is
written to a temporary directory beside OUT_DIR and renamed into place: OUT_DIR appears complete or not at all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from hf_scale.errors import UserError
from hf_scale.export import qlora as qlora_export
from hf_scale.export.checkpoint_readers import Source, find_source, with_adapter_names, with_model_names
from hf_scale.knowledge import rules
from hf_scale.knowledge.model_shapes import CONFIG_ERRORS, read_config_json

if TYPE_CHECKING:
    from hf_scale.contract.checkpoint_layout import Layout

DTYPES = rules.DTYPE_CHOICES
LORA_MODES = ("adapter", "merged")

EPILOG = """\
CHECKPOINT_DIR is a complete OUTPUT_DIR/checkpoint-STEP written by train.py (either loop; DeepSpeed
ZeRO-1/2/3, FSDP2, accelerate's FSDP plugin on GPUs or DDP), or OUTPUT_DIR itself: its newest checkpoint
of verified content is exported (named on stderr). Every file is first checked against the checksum recorded
in hf_scale_complete.json, as --resume_from_checkpoint does (it reads the whole checkpoint once); an
incomplete checkpoint or one whose content does not verify is refused, naming the file.

examples:
  hf-scale export outputs/run/checkpoint-500 exported/                      # the dtype it was trained in
  hf-scale export outputs/run exported/                                     # the run's newest verified checkpoint
  hf-scale export outputs/run/checkpoint-500 exported-bf16/ --dtype bf16 --max-shard-size 2GB
  hf-scale export outputs/lora/checkpoint-200 adapter/                      # LoRA: the adapter only
  hf-scale export outputs/lora/checkpoint-200 merged/ --lora merged         # LoRA merged into the base
  hf-scale export outputs/qlora/checkpoint-200 merged/ --merge              # the same; QLoRA: a bf16 model
  hf-scale export outputs/run/checkpoint-500 exported/ --push-to-hub me/my-model   # then upload it (HF_TOKEN)
  python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('exported/')"
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        description="Consolidate a train.py checkpoint into config + sharded safetensors (with index) + "
        "tokenizer + generation config that from_pretrained loads without DeepSpeed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="a complete OUTPUT_DIR/checkpoint-STEP, or OUTPUT_DIR (its newest verified checkpoint)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where the model goes (must not exist, or be empty)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights' dtype: bf16|bfloat16, fp16|float16, fp32|float32 (either spelling); auto (default) = the "
        "dtype in the checkpoint's config.json (what training loaded)",
    )
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument(
        "--lora",
        choices=LORA_MODES,
        help="LoRA checkpoints: adapter (default; adapter_model.safetensors + adapter_config.json) or merged "
        "(the adapter merged into the base weights: a plain model; a QLoRA run's 4-bit base is dequantized)",
    )
    lora.add_argument("--merge", action="store_true", help="the same as --lora merged")
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB, 500MB (default 5GB); bigger models are split, with an index",
    )
    parser.add_argument(
        "--push-to-hub",
        metavar="REPO_ID",
        help="after writing OUT_DIR, upload it to this Hub model repository (created if missing); the token is "
        "HF_TOKEN or the one saved by `hf auth login`, the endpoint HF_ENDPOINT",
    )
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the checksums (the manifest and the file sizes are still checked): export a checkpoint whose "
        "content does not verify (an older hf_scale's size-only manifest, a file you know was changed), or save "
        "reading the whole checkpoint once more",
    )
    parser.set_defaults(func=run_export)


def run_export(args) -> int:
    from hf_scale import quiet
    from hf_scale.files import hub

    target = None
    if args.push_to_hub is not None:
        target = hub.HubTarget(repo_id=args.push_to_hub, private=True if args.private else None)
        hub.check_target(target, "--push-to-hub")
    elif args.private:
        raise UserError("--private: only used with --push-to-hub REPO_ID")
    verbose = args.verbose or quiet.verbose_requested()
    with quiet.transformers_progress_bars_on_a_terminal(verbose):
        out_dir = export(
            Path(args.checkpoint_dir),
            Path(args.out_dir),
            dtype=args.dtype,
            lora="merged" if args.merge else args.lora,
            lora_flag="--merge" if args.merge else None,
            max_shard_size=args.max_shard_size,
            verify=args.verify,
            progress=quiet.draw_progress_bars(verbose),
        )
    if target is not None:
        from hf_scale.contract.checkpoint_layout import TRAINING_STATE_GLOBS

        hub.push_folder(out_dir, target, "--push-to-hub", message=f"hf-scale export of {args.checkpoint_dir}",
                        ignore=TRAINING_STATE_GLOBS)
    return 0


def _log(message: str) -> None:
    print(f"hf-scale export: {message}", file=sys.stderr, flush=True)


def export(checkpoint_dir: Path, out_dir: Path, *, dtype: str = "auto", lora: str | None = None,
           lora_flag: str | None = None, max_shard_size: str = "5GB", verify: bool = True,
           progress: bool = True) -> Path:
    """Write the Hugging Face directory for `checkpoint_dir` to `out_dir` (atomically); returns out_dir. With
    `verify`, only a checkpoint whose content verifies (`checkpoint_verification.verify`, as a resume) is read.
    `lora_flag`: the flag that asked for `lora` as the user typed it (`--merge`), for the errors; default `--lora
    LORA`. `progress`: draw the bar of the tensors read (the command: on a terminal or with --verbose,
    hf_scale.quiet)."""
    from hf_scale.contract.checkpoint_layout import ADAPTER_CONFIG

    _validate_shard_size(max_shard_size)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"OUT_DIR {out_dir}: exists and is not a directory; give a new or empty directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"OUT_DIR {out_dir}: already exists and is not empty; choose a new directory")
    found, verified = _checkpoint_of(checkpoint_dir, verify)
    checkpoint_dir = found.path
    is_lora = (checkpoint_dir / ADAPTER_CONFIG).is_file()
    if lora and not is_lora:
        raise UserError(f"{lora_flag or f'--lora {lora}'}: {checkpoint_dir} is not a LoRA checkpoint (no "
                        f"{ADAPTER_CONFIG}); its model exports as it is, without the flag")
    lora_mode = (lora or "adapter") if is_lora else None

    with _reading(checkpoint_dir):
        # QLoRA merged: only the adapter is read from the checkpoint; the 4-bit base is loaded again, dequantized.
        qlora = qlora_export.quantization_of(checkpoint_dir) if lora_mode == "merged" else None
        source = qlora_export.adapter_source(found) if qlora else find_source(found)
        torch_dtype = None if qlora and dtype == "auto" else _resolve_dtype(dtype, checkpoint_dir)
        if verify and not verified:  # after the cheap refusals: verifying reads the whole checkpoint (~1 TB at 70B)
            _verified(checkpoint_dir)
    what = "the QLoRA adapter (its 4-bit base loaded again) from " if qlora else ""
    count = sum("lora_" in n for n in source.names) if qlora else len(source.names)
    _log(f"reading {what}{checkpoint_dir} ({source.description}, {count} tensors)")

    tmp = out_dir.parent / f".tmp-export-{out_dir.name}-{os.getpid()}"
    try:
        with _writing(out_dir):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        with _reading(checkpoint_dir):
            if qlora:
                model = qlora_export.dequantized_with_adapter(checkpoint_dir, qlora)
            else:
                model = _build_model(checkpoint_dir, torch_dtype, is_lora)
            source = with_adapter_names(source, model) if is_lora else with_model_names(source, model)
            only_adapter = lora_mode == "adapter" or bool(qlora)
            wanted = [n for n in source.names if "lora_" in n] if only_adapter else source.names
            # QLoRA: the adapter in fp32, merged into the fp32 dequantized base, and only then cast.
            _fill(model, source, wanted, qlora_export.merge_dtype() if qlora else torch_dtype,
                  only_adapter=only_adapter, progress=progress)
            tokenizer = _load_tokenizer(checkpoint_dir)
        if lora_mode == "merged":
            _log("merging the LoRA adapter into the base weights")
            model = qlora_export.merged(model, qlora, torch_dtype) if qlora else model.merge_and_unload()
        what = "LoRA adapter" if lora_mode == "adapter" else f"model ({str(model.dtype).removeprefix('torch.')})"
        _log(f"writing the {what} to {out_dir} (shards of at most {max_shard_size})")
        with _writing(out_dir):
            model.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)
            if lora_mode == "adapter":
                qlora_export.check_adapter(tmp)
            tokenizer.save_pretrained(tmp)
            _apply_umask(tmp)
            if out_dir.exists():
                out_dir.rmdir()  # empty (checked above); rename needs the name free
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in out_dir.iterdir())
    _log(f"done: {out_dir} ({', '.join(files)})")
    return out_dir


def _checkpoint_of(path: Path, verify: bool) -> tuple[Layout, bool]:
    """The checkpoint to export, and whether its content is verified already: `path` itself (not yet: the caller
    verifies it after its cheap refusals), or for a training output directory (OUTPUT_DIR holding checkpoint-STEP
    folders) its newest checkpoint of verified content (`checkpoint_verification.newest_verified`, what
    `--resume_from_checkpoint auto` takes; without `verify` its newest complete one), said in one line on stderr.
    Everything else is refused in one line saying what `path` is, or which file of it does not verify."""
    from hf_scale.contract import checkpoint_layout

    chosen = False
    with _reading(path):
        found = checkpoint_layout.detect_layout(path)
        if found.kind == checkpoint_layout.RUN_DIR:
            newest, skipped = _newest_of_run(path, found, verify)
            if newest is None:
                _refuse(found, verify, skipped)
            what = "verified" if verify else "complete"
            _log(f"{path} is a training output directory: exporting its newest {what} checkpoint, {newest.name}"
                 + (f" ({', '.join(skipped)})" if skipped else ""))
            found, chosen = checkpoint_layout.detect_layout(newest), True
    if found.kind == checkpoint_layout.CHECKPOINT:
        return found, chosen and verify
    _refuse(found, verify)


def _newest_of_run(path: Path, found: Layout, verify: bool) -> tuple[Path | None, list[str]]:
    """The checkpoint of run directory `path` to export, and the newer ones passed over ("NAME: why")."""
    from hf_scale.contract import checkpoint_layout, checkpoint_verification

    if not verify:
        newest = found.newest
        newer = [p for p in found.checkpoints
                 if newest and checkpoint_layout.step_of(p) > checkpoint_layout.step_of(newest)]
        return newest, [f"{p.name} incomplete" for p in newer]
    started = time.perf_counter()
    newest, skipped = checkpoint_verification.newest_verified(path)
    if newest is not None:
        _log_verified(newest, started)
    return newest, [f"{p.name}: {why}" for p, why in skipped]


def _verified(path: Path) -> None:
    """Every file of checkpoint `path` against its manifest's checksums (`checkpoint_verification.verify`, as a
    resume), or a one-line refusal naming the first that differs and the newest sibling that verifies."""
    from hf_scale.contract import checkpoint_verification

    started = time.perf_counter()
    problem = checkpoint_verification.verify(path)
    if problem is None:
        _log_verified(path, started)
        return
    raise UserError(f"CHECKPOINT_DIR {path}: {problem}; it was left as it is; {_sibling_note(path)} (--no-verify "
                    "exports it as it is)")


def _log_verified(path: Path, started: float) -> None:
    """One progress line for a checkpoint whose content verified: how much was read and how long it took."""
    from hf_scale.contract.checkpoint_layout import MANIFEST

    _log(f"verified {path.name} against its {MANIFEST} ({_size_of(path)}, {time.perf_counter() - started:.1f} s)")


def _sibling_note(path: Path) -> str:
    """The newest checkpoint of verified content beside checkpoint `path`, for a refusal."""
    from hf_scale.contract import checkpoint_layout, checkpoint_verification

    if checkpoint_layout.step_of(path) is None:
        return "export a complete OUTPUT_DIR/checkpoint-STEP"
    newest, _ = checkpoint_verification.newest_verified(path.parent)
    if newest is None:
        return "export a complete OUTPUT_DIR/checkpoint-STEP"
    return f"the newest verified one beside it is {newest}"


def _size_of(path: Path) -> str:
    from hf_scale.contract import checkpoint_layout

    entries, _ = checkpoint_layout.read_manifest(path)
    size = sum(e["size"] for e in (entries or {}).values())
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def _refuse(found: Layout, verify: bool, skipped: list[str] = ()) -> NoReturn:
    """Why the directory `detect_layout` described cannot be exported, in one line (`skipped`: a run directory's
    checkpoints, "NAME: why not", when none verifies)."""
    from hf_scale.contract import checkpoint_layout

    path = found.path
    if found.kind == checkpoint_layout.UNKNOWN and found.problem in ("not a directory", "no such directory"):
        raise UserError(f"CHECKPOINT_DIR {path}: {'is not a directory' if path.exists() else 'no such directory'}")
    if found.kind == checkpoint_layout.HF_MODEL:
        raise UserError(f"CHECKPOINT_DIR {path}: a saved Hugging Face model, not a checkpoint: from_pretrained "
                        "loads it as it is (export takes an OUTPUT_DIR/checkpoint-STEP)")
    note = " (its final model is already in it: from_pretrained loads that directory)" if found.final_model else ""
    if found.kind == checkpoint_layout.RUN_DIR and verify:  # without a checkpoint of verified content
        raise UserError(f"CHECKPOINT_DIR {path}: a training output directory without a checkpoint of verified "
                        f"content ({'; '.join(skipped)}){note}")
    if found.kind == checkpoint_layout.RUN_DIR:  # without a complete checkpoint
        names = ", ".join(p.name for p in found.checkpoints)
        verb = "is" if len(found.checkpoints) == 1 else "are"
        raise UserError(f"CHECKPOINT_DIR {path}: a training output directory without a complete checkpoint ({names} "
                        f"{verb} incomplete: no valid {checkpoint_layout.MANIFEST}){note}")
    # An incomplete checkpoint, or a directory that is none of the above.
    if verify and found.kind == checkpoint_layout.INCOMPLETE:
        sibling = _sibling_note(path)
    else:
        sibling = (f"the newest complete one beside it is {found.newest}" if found.newest
                   else "export a complete OUTPUT_DIR/checkpoint-STEP")
    why = found.problem if found.kind == checkpoint_layout.INCOMPLETE else f"no valid {checkpoint_layout.MANIFEST}"
    raise UserError(f"CHECKPOINT_DIR {path}: incomplete or corrupt checkpoint ({why}); {sibling}")


def _validate_shard_size(size: str) -> None:
    from transformers.utils.hub import convert_file_size_to_int

    try:
        valid = convert_file_size_to_int(size) > 0
    except (ValueError, TypeError):
        valid = False
    if not valid:
        raise UserError(f"--max-shard-size {size!r}: expected a size like 5GB, 500MB or 2GiB")


def _resolve_dtype(dtype: str, checkpoint_dir: Path):
    import torch

    try:
        name = rules.torch_dtype_name(dtype, "--dtype")
    except ValueError as error:
        raise UserError(str(error)) from None
    config = read_config_json(checkpoint_dir / "config.json", f"CHECKPOINT_DIR {checkpoint_dir}")  # any --dtype
    if name == rules.AUTO_DTYPE:
        saved = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        name = rules.TORCH_DTYPE_OF.get(saved, saved)  # a saved "bf16" too; any other torch dtype as saved
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else torch.float32


def _build_model(checkpoint_dir: Path, torch_dtype, is_lora: bool):
    """The model with every weight on the meta device (no memory); buffers computed on the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(checkpoint_dir)
    # train.py turns the KV cache off for training; the exported model is for inference.
    config.use_cache = True
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        if is_lora:
            from peft import LoraConfig, get_peft_model

            lora_config = LoraConfig.from_pretrained(str(checkpoint_dir))
            base_path = lora_config.base_model_name_or_path
            model = get_peft_model(model, lora_config)
            # get_peft_model records the config's directory (the checkpoint) as the base; keep the real one.
            model.peft_config[model.active_adapter].base_model_name_or_path = base_path
    if (checkpoint_dir / "generation_config.json").is_file():
        base = model.get_base_model() if is_lora else model
        base.generation_config = GenerationConfig.from_pretrained(checkpoint_dir)
    return model


def _batches(names: list[str], size: int = 16) -> Iterator[list[str]]:
    """A few names at a time: DCP reads its metadata once per call, and few tensors are in flight."""
    for start in range(0, len(names), size):
        yield names[start : start + size]


def _fill(model, source: Source, names: list[str], torch_dtype, *, only_adapter: bool, progress: bool) -> None:
    """Put every tensor in place (cast to the output dtype), then check nothing is missing."""
    from accelerate.utils import set_module_tensor_to_device
    from tqdm import tqdm

    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    unknown = [n for n in names if n not in targets]
    if unknown:
        raise UserError(
            f"checkpoint tensor {unknown[0]} (and {len(unknown) - 1} more) does not exist in the model built from "
            "the checkpoint's config.json; the checkpoint and its config do not belong together"
        )
    with tqdm(total=len(names), desc="loading tensors", unit="tensor", file=sys.stderr, disable=not progress) as bar:
        for group in _batches(names):
            for name, tensor in source.read(group).items():
                if tensor.shape != targets[name].shape:  # an empty ZeRO-3 adapter tensor, a foreign checkpoint
                    raise UserError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model built "
                                    f"from the checkpoint's config.json {tuple(targets[name].shape)}")
                cast = torch_dtype if tensor.is_floating_point() else None
                set_module_tensor_to_device(model, name, "cpu", value=tensor, dtype=cast)
                bar.update(1)
    # Weights shared with another (tied embeddings) are saved once; tie them again.
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta and not (only_adapter and "lora_" not in n)]
    if missing:
        raise UserError(f"checkpoint lacks {len(missing)} weights of the model, e.g. {missing[0]}")


def _load_tokenizer(checkpoint_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_dir)


def _read_errors() -> tuple[type[BaseException], ...]:
    """What the readers of a checkpoint (json, safetensors, torch.load, DeepSpeed's zero_to_fp32, torch DCP,
    transformers' configs, model classes and tokenizers) raise on a damaged or foreign file."""
    import pickle

    from safetensors import SafetensorError

    return (*CONFIG_ERRORS, OSError, EOFError, pickle.UnpicklingError, SafetensorError)


@contextlib.contextmanager
def _reading(checkpoint_dir: Path) -> Iterator[None]:
    """A damaged checkpoint is bad input: one line naming it and what failed, not a traceback."""
    try:
        yield
    except _read_errors() as error:
        detail = " ".join(str(error).split())[:300] or type(error).__name__
        raise UserError(f"CHECKPOINT_DIR {checkpoint_dir}: cannot be read ({type(error).__name__}: {detail})") from None


@contextlib.contextmanager
def _writing(out_dir: Path) -> Iterator[None]:
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as error:  # safetensors reports a full disk as its own error
        detail = getattr(error, "strerror", None) or " ".join(str(error).split())[:300]
        raise UserError(f"OUT_DIR {out_dir}: cannot write ({detail}); nothing was written") from None


def _apply_umask(directory: Path) -> None:
    """save_pretrained's temporary files may keep mode 0600; give the exported files the user's umask."""
    from hf_scale.files.writing import file_mode

    for path in directory.rglob("*"):
        if path.is_file():
            os.chmod(path, file_mode())
