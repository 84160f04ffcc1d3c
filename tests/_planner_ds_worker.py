"""2-process DeepSpeed worker for tests/planner/test_planner_deepspeed.py (run with `torchrun --nproc_per_node 2`).

Builds the tiny Llama, initialises the real DeepSpeed engine over gloo with the DeepSpeed JSON that
``hf-scale generate --deepspeed-mode resolved`` writes for the given ZeRO stage (fp32, torch AdamW), takes one
optimizer step so the Adam states exist, runs the next forward+backward (the point where parameters,
master weights, optimizer states and gradients all coexist) and writes, per rank, the bytes the engine
holds in each category to ``OUT_DIR/rank{N}.json``.

What is summed (bytes of memory covered by the tensors, views of one buffer counted once):
  params     ZeRO-1/2: the flat buffer every parameter is a view of (``bit16_groups_flat``).
             ZeRO-3: each parameter's partition (``ds_tensor``) plus the full ``param.data`` of the
             parameters that stay gathered (persistent ones; released ones have 0 elements).
  master     the partitioned fp32 master weights (``single_partition_of_fp32_groups`` /
             ``fp32_partitioned_groups_flat``).
  optimizer  AdamW's ``exp_avg`` and ``exp_avg_sq`` of every state; the 0-dim ``step`` counter (4 bytes per
             flat parameter group) is not a per-parameter state and is left out.
  grads      every gradient still referenced: ``param.grad`` of the model's parameters, ZeRO-1/2's
             ``averaged_gradients`` and contiguous ``grads_in_partition`` buffer, ZeRO-3's
             ``grad_partitions_flat_buffer``.
Categories are checked to be disjoint, so their sum is the model-state memory of the rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from hf_scale.config.distributed_config import load_config
from hf_scale.contract.deepspeed_json import deepspeed_config

TINY_LLAMA = Path(__file__).resolve().parents[1] / "hf_scale" / "assets" / "tiny-llama"


def _ranges(tensors) -> set[tuple[int, int]]:
    spans = set()
    for tensor in tensors:
        if tensor is not None and tensor.numel() > 0:
            start = tensor.data_ptr()
            spans.add((start, start + tensor.numel() * tensor.element_size()))
    return spans


def _covered(spans: set[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _held(engine, stage: int) -> dict[str, list[tuple[int, int]]]:
    zero = engine.optimizer
    params = list(engine.module.parameters())
    grads = [p.grad for p in params]
    if stage < 3:
        held_params = list(zero.bit16_groups_flat)
        master = list(zero.single_partition_of_fp32_groups)
        averaged = zero.averaged_gradients.values() if isinstance(zero.averaged_gradients, dict) else []
        grads += [g for group in averaged for g in (group or [])]
        grads.append(getattr(zero, "grads_in_partition", None))
    else:
        held_params = [p.ds_tensor for p in params] + [p.data for p in params]
        master = list(zero.fp32_partitioned_groups_flat)
        grads.append(zero.grad_partitions_flat_buffer)
    states = [
        value
        for state in zero.optimizer.state.values()
        for key, value in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    ]
    return {
        "params": _covered(_ranges(held_params)),
        "master": _covered(_ranges(master)),
        "optimizer": _covered(_ranges(states)),
        "grads": _covered(_ranges(grads)),
    }


def main() -> None:
    stage, persistence_threshold, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = load_config(
        overrides=[
            "strategy=deepspeed",
            "precision='no'",
            f"topology.processes_per_machine={dist.get_world_size()}",
            f"deepspeed.zero_stage={stage}",
            "deepspeed.torch_adam=true",
            f"deepspeed.stage3_param_persistence_threshold={persistence_threshold}",
        ]
    )
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA))
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=deepspeed_config(cfg, "resolved"), model_parameters=model.parameters()
    )
    generator = torch.Generator().manual_seed(rank)
    for step in range(2):
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        if step == 0:
            engine.step()
    held = _held(engine, stage)
    spans = [span for category in held.values() for span in category]
    # Memory counted in two categories would make the sum larger than what the union covers.
    overlap = sum(end - start for start, end in _covered(set(spans))) != sum(end - start for start, end in spans)
    result = {name: sum(end - start for start, end in category) for name, category in held.items()}
    result.update(rank=rank, world_size=dist.get_world_size(), stage=stage, overlapping_categories=overlap)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
