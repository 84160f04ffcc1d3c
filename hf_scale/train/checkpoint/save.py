"""The final save — a Hugging Face model directory loadable without DeepSpeed — and its proof.

The proof compares what was written with what was trained, tensor by tensor: every rank walks the trained
model's tensors in the same order, one at a time (ZeRO-3: gathered with `deepspeed.zero.GatheredParameters`;
FSDP2: `DTensor.full_tensor()`; otherwise the module's own tensor), and the main process reads the saved
safetensors entry of the same name alone (`safe_open`, opened per tensor so no shard stays mapped) and
compares it EXACTLY with the live tensor cast to the saved dtype (a tensor transformers keeps in another form at run
time than on disk, such as a mixture-of-experts model's fused experts, is compared as the pieces `save_pretrained`
wrote for it: hf_scale.knowledge.weight_conversion): bit for bit, in any precision (bf16 saves
of ZeRO-3's 16-bit weights, fp32 saves of fp32 masters). No model is reloaded and nothing runs forward,
so the cost is one read of the saved bytes, and host memory holds one tensor at a time — it scales to 70B.

It catches what the check exists for: an empty or partial ZeRO-3 save (missing or 0-element tensors), an
empty LoRA adapter, keys that kept torch.compile's `_orig_mod.` prefix, wrong values. The result is
written to `hf_scale_verify.json`; a failure is one line on stderr and exit code 1. (ZeRO-3 without 16-bit
gathering saves no model: its final save is a checkpoint, proved by hf_scale.train.checkpoint.final_checkpoint.)
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_scale.knowledge import weight_conversion

REPORT_FILE = "hf_scale_verify.json"
MODEL_FILE = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"
SHOWN = 3  # example names per kind of problem in the one-line error


def save_with_accelerator(accelerator, model, tokenizer, output_dir: str) -> None:
    """Manual loop: gather (ZeRO-3: 16-bit weights) and write safetensors + tokenizer."""
    accelerator.wait_for_everyone()
    # (ZeRO-3 without gathering never comes here: its final save is a checkpoint, final_checkpoint.py.)
    state_dict = _gathered_state_dict(accelerator, model)
    # --torch_compile: accelerate keeps the compiled wrapper, whose keys carry `_orig_mod.`; a saved model
    # must use the plain module's names (found by the save verification below).
    if state_dict is not None:  # ZeRO-3 gathers onto the main process only
        state_dict = {key.removeprefix("_orig_mod."): value for key, value in state_dict.items()}
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    unwrapped.save_pretrained(
        output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state_dict,
        safe_serialization=True,
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def _gathered_state_dict(accelerator, model) -> dict:
    """The full state dict; a collective under ZeRO-3 and FSDP (every rank calls it)."""
    from hf_scale.train.model.parallelize import has_dtensors

    if has_dtensors(model) and accelerator.distributed_type.name != "FSDP":
        from hf_scale.train.model.fsdp import full_state_dict

        # Sharded by fsdp.shard_on_cpu or built on a TP mesh (parallel.py): accelerate can't gather it.
        return full_state_dict(model)
    return accelerator.get_state_dict(model)


# --- the proof ------------------------------------------------------------------------------------------


class SavedTensors:
    """The safetensors files of a saved directory, read one tensor at a time."""

    def __init__(self, output_dir: str | Path, *, adapter: bool):
        from safetensors import safe_open

        self._safe_open = safe_open
        directory = Path(output_dir)
        self.where: dict[str, Path] = {}
        if adapter:
            files = [directory / ADAPTER_FILE]
        elif (directory / MODEL_INDEX).is_file():
            weight_map = json.loads((directory / MODEL_INDEX).read_text())["weight_map"]
            self.where = {key: directory / name for key, name in weight_map.items()}
            files = []
        else:
            files = [directory / MODEL_FILE]
        for file in files:
            if file.is_file():
                with safe_open(file, framework="pt") as f:
                    self.where.update(dict.fromkeys(f.keys(), file))
        self.files = sorted({str(path) for path in self.where.values()} | {str(f) for f in files if f.is_file()})

    def shape(self, key: str) -> list[int]:
        with self._safe_open(self.where[key], framework="pt") as f:
            return list(f.get_slice(key).get_shape())

    def read(self, key: str) -> torch.Tensor:
        # Opened per tensor: a shard kept open stays memory-mapped, and its pages would count as resident.
        with self._safe_open(self.where[key], framework="pt") as f:
            return f.get_tensor(key)


def live_tensors(model) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """(names a save may give it, tensor) for every distinct tensor of the unwrapped trained model, in
    state_dict order — identical on every rank. Tied weights are one tensor with several names; a LoRA
    model is its adapter, named as peft saves it."""
    named = model.state_dict(keep_vars=True)  # the parameters themselves: no copy, ZeRO-3 placeholders stay
    if getattr(model, "peft_config", None):
        from peft import get_peft_model_state_dict

        named = get_peft_model_state_dict(model, state_dict=named)
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in named.items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return [(tuple(names), tensor) for names, tensor in groups.values()]


@contextlib.contextmanager
def _materialized(tensor: torch.Tensor):
    """The whole tensor on every rank, for the duration of the block (a collective when it is sharded)."""
    if hasattr(tensor, "ds_id"):  # a ZeRO-3 partition
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            yield tensor.data
        return
    from torch.distributed.tensor import DTensor

    yield tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


@dataclass
class _Findings:
    checked: int = 0
    bytes_read: int = 0
    largest_tensor_bytes: int = 0
    dtypes: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    wrong_shape: list[str] = field(default_factory=list)
    wrong_values: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    @property
    def problems(self) -> dict[str, list[str]]:
        kinds = {"missing": self.missing, "wrong_shape": self.wrong_shape, "wrong_values": self.wrong_values,
                 "unexpected": self.unexpected, "unreadable": self.unreadable}
        return {kind: items for kind, items in kinds.items() if items}


def _compare(saved: SavedTensors, names: tuple[str, ...], full: torch.Tensor, findings: _Findings,
             seen: set[str], model) -> None:
    """Compare one trained tensor with what was saved of it: under one of its names, or, for a tensor transformers
    keeps in another form at run time (fused MoE experts; `model` None: a LoRA adapter, saved by peft as it is),
    the pieces `save_pretrained` writes for it (hf_scale.knowledge.weight_conversion)."""
    key = next((name for name in names if name in saved.where), None)
    if key is not None:
        seen.update(name for name in names if name in saved.where)
        expected = {key: full}
    else:
        expected = weight_conversion.saved_form(model, names[0], full) if model is not None else {names[0]: full}
        absent = [piece for piece in expected if piece not in saved.where]
        if len(absent) == len(expected):
            findings.missing.append(names[0])
            return
        seen.update(piece for piece in expected if piece in saved.where)
        if absent:  # a partial save of it: the pieces it lacks
            findings.missing.extend(absent)
            return
    if all(_compare_saved(saved, piece, value, findings) for piece, value in expected.items()):
        findings.checked += 1


def _compare_saved(saved: SavedTensors, key: str, full: torch.Tensor, findings: _Findings) -> bool:
    """Compare the saved tensor `key` with `full`, exactly after casting; False when its shape differs (nothing
    compared)."""
    shape, want = saved.shape(key), list(full.shape)
    if shape != want:
        findings.wrong_shape.append(f"{key} saved {shape}, trained {want}")
        return False
    stored = saved.read(key)
    findings.bytes_read += stored.numel() * stored.element_size()
    findings.largest_tensor_bytes = max(findings.largest_tensor_bytes, stored.numel() * stored.element_size())
    findings.dtypes.add(str(stored.dtype).removeprefix("torch."))
    # Compared where the live tensor is (a GPU under DeepSpeed/FSDP): host memory holds the saved tensor only.
    stored = stored.to(full.device)
    live = full.to(stored.dtype)
    if not torch.equal(_bits(live), _bits(stored)):
        differing = int((live != stored).sum()) or stored.numel()  # NaN bits differ too
        diff = float((live.float() - stored.float()).abs().nan_to_num(float("inf")).max())
        findings.wrong_values.append(f"{key} ({differing} of {stored.numel()} values, max abs diff {diff:.3g})")
    return True


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its own width: equal bits, equal tensors (NaNs and -0.0 included),
    compared 4x faster than bytes."""
    return tensor.contiguous().view(_SAME_SIZE_INT.get(tensor.element_size(), torch.uint8))


@torch.no_grad()
def verify_saved_model(output_dir: str | Path, model, *, is_main_process: bool) -> dict | None:
    """Compare the saved directory with the trained (unwrapped, possibly sharded) `model`.

    A collective: every rank calls it. The main process writes REPORT_FILE and returns the report
    (``ok``, counts, bytes, seconds, peak host memory, problems); the other ranks return None.
    """
    is_lora = bool(getattr(model, "peft_config", None))
    rss_before = _reset_peak_rss() if is_main_process else 0
    started = time.perf_counter()
    findings, seen = _Findings(), set()
    saved = None
    if is_main_process:
        try:
            saved = SavedTensors(output_dir, adapter=is_lora)
        except Exception as error:  # noqa: BLE001 - a damaged index or header: reported, never a hang
            findings.unreadable.append(f"{output_dir}: {' '.join(str(error).split())[:200]}")
    tensors = live_tensors(model)
    for names, tensor in tensors:
        with _materialized(tensor) as full:  # every rank, same order: the gathers are collectives
            if saved is None:
                continue
            try:
                _compare(saved, names, full, findings, seen, None if is_lora else model)
            except Exception as error:  # noqa: BLE001 - the other ranks wait in the next gather: keep going
                findings.unreadable.append(f"{names[0]}: {type(error).__name__}: {' '.join(str(error).split())[:200]}")
    if not is_main_process:
        return None
    findings.unexpected = sorted(set(saved.where) - seen) if saved else []
    report = {
        "ok": not findings.problems and findings.checked > 0,
        "what": "LoRA adapter" if is_lora else "model",
        "files": [os.path.relpath(f, output_dir) for f in saved.files] if saved else [],
        "tensors_expected": len(tensors),
        "tensors_checked": findings.checked,
        "bytes_read": findings.bytes_read,
        "largest_tensor_bytes": findings.largest_tensor_bytes,
        "saved_dtypes": sorted(findings.dtypes),
        "seconds": round(time.perf_counter() - started, 3),
        "rss_before_bytes": rss_before,
        "peak_host_rss_bytes": _peak_rss(),
        "comparison": "exact (bitwise) after casting the trained tensor to the saved dtype",
        "problems": findings.problems,
    }
    Path(output_dir, REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def failure_message(report: dict, output_dir: str | Path) -> str:
    """The one-line error for a report that is not ok."""
    if not report["files"] and not report["problems"].get("unreadable"):
        wanted = ADAPTER_FILE if report["what"] == "LoRA adapter" else f"{MODEL_FILE} or {MODEL_INDEX}"
        return (f"the saved {report['what']} in {output_dir} has no {wanted}; `hf-scale export {output_dir} OUT` "
                "turns the run's newest complete checkpoint into a model")
    parts = []
    labels = {"missing": "missing", "wrong_shape": "with another shape (empty or partial save)",
              "wrong_values": "with other values", "unexpected": "saved under names the model does not have",
              "unreadable": "that could not be read"}
    for kind, items in report["problems"].items():
        examples = ", ".join(items[:SHOWN]) + (", …" if len(items) > SHOWN else "")
        parts.append(f"{len(items)} tensor(s) {labels[kind]} (e.g. {examples})")
    if not parts:
        parts.append("no tensor was compared")
    return (
        f"the saved {report['what']} in {output_dir} does not match the trained weights: {'; '.join(parts)}; "
        f"see {Path(output_dir) / REPORT_FILE}"
    )


def _reset_peak_rss() -> int:
    """Current resident memory, with the kernel's peak (VmHWM) reset to it, so the peak then is the check's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS:") or 0


def _peak_rss() -> int:
    peak = _status_bytes("VmHWM:")
    if peak is None:  # not Linux: the process's lifetime peak
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    return int(peak)


def _status_bytes(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
