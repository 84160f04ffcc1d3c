"""Predicted vs measured peak GPU memory of the planner's candidates (needs CUDA GPUs; target within +-10%).

    python benchmarks/planner_gpu_memory.py                 # every visible GPU, default candidates
    python benchmarks/planner_gpu_memory.py --gpus 2 --seq-len 2048 --candidates ddp zero2 zero3

For each candidate a fresh ``torchrun`` job (NCCL, one process per GPU) builds a randomly initialised Llama
of BENCH_MODEL's shapes (nothing downloaded), trains 3 steps on random tokens with the strategy as
``hf-scale generate`` configures it (DeepSpeed JSON from the planner's DistributedConfig; FSDP2 via
``fully_shard`` per decoder layer with bf16 compute / fp32 reduce as accelerate sets it; DDP with bf16
autocast), and reports ``torch.cuda.max_memory_allocated()`` on rank 0 over those steps (the planner
estimates what PyTorch allocates; the CUDA context and allocator caching are the safety margin's job).
Results go to benchmarks/results/planner_gpu_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# ~0.85B parameters: big enough that model states, activations and logits are all visible, small enough
# that every candidate, DDP included, fits one 80 GB GPU.
BENCH_MODEL = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=5632,
    vocab_size=32000,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)
DEFAULT_CANDIDATES = ["ddp", "zero1", "zero2", "zero3", "zero3_offload_opt", "fsdp2_full_shard", "zero2_ac", "zero3_ac"]
RESULTS = Path(__file__).resolve().parent / "results" / "planner_gpu_memory.json"
STEPS = 3


def _plan(gpus: int, seq_len: int, micro_batch: int):
    from transformers import LlamaConfig

    from hf_scale.planner import Workload, make_plan, model_shapes

    shapes = model_shapes(LlamaConfig(**BENCH_MODEL), name="bench-llama-0.85b")
    workload = Workload(shapes, gpus_per_machine=gpus, machines=1, seq_len=seq_len, micro_batch=micro_batch)
    return make_plan(workload, gpu_memory=10**15)  # everything "fits": we only want the estimates


def _worker(slug: str, seq_len: int, micro_batch: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_scale.generators.deepspeed_json import deepspeed_config
    from hf_scale.planner import distributed_config

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    plan = _plan(world, seq_len, micro_batch)
    assessment = next(a for a in plan.assessments if a.slug == slug)
    candidate, predicted = assessment.candidate, assessment.estimate
    torch.manual_seed(0)
    config = LlamaConfig(**BENCH_MODEL)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    if candidate.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device = torch.device("cuda", local_rank)

    if candidate.engine == "deepspeed":
        import deepspeed

        ds = deepspeed_config(distributed_config(plan, assessment), "resolved")
        zero = ds["zero_optimization"]
        # The values the HF Trainer fills for "auto" (the planner assumes them).
        hidden = config.hidden_size
        zero["reduce_bucket_size"] = hidden * hidden
        if candidate.zero_stage == 3:
            zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
            zero["stage3_param_persistence_threshold"] = 10 * hidden
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())

        def step(ids):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    else:
        model.to(device)
        if candidate.engine == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            wrapped = model
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(ids):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=candidate.engine == "ddp"):
                loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    generator = torch.Generator(device=device).manual_seed(local_rank)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device, generator=generator)
        step(ids)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    if dist.get_rank() == 0:
        row = {
            "candidate": slug,
            "label": candidate.label,
            "activation_checkpointing": candidate.activation_checkpointing,
            "predicted_bytes": predicted.gpu_total,
            "predicted_breakdown": predicted.breakdown(),
            "measured_peak_allocated_bytes": measured,
            "measured_over_predicted": round(measured / predicted.gpu_total, 4),
        }
        out.write_text(json.dumps(row), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="processes/GPUs (default: all visible)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--candidates", nargs="+", default=DEFAULT_CANDIDATES, metavar="SLUG")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--worker", metavar="SLUG", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.seq_len, args.micro_batch, args.worker_out)
        return 0

    import deepspeed
    import torch

    if not torch.cuda.is_available():
        print("planner_gpu_memory: no CUDA GPU visible; this benchmark needs one", file=sys.stderr)
        return 2
    gpus = args.gpus or torch.cuda.device_count()
    rows = []
    for slug in args.candidates:
        with tempfile.TemporaryDirectory() as tmp:
            row_path = Path(tmp) / "row.json"
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
                __file__, "--worker", slug, "--worker-out", str(row_path),
                "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0 or not row_path.exists():
                rows.append({"candidate": slug, "error": done.stderr[-2000:]})
                print(f"{slug:32s} FAILED (exit {done.returncode})")
                continue
            row = json.loads(row_path.read_text())
        row["within_10_percent"] = abs(row["measured_over_predicted"] - 1) <= 0.10
        rows.append(row)
        print(
            f"{slug:32s} predicted {row['predicted_bytes'] / 2**30:7.2f} GiB  measured "
            f"{row['measured_peak_allocated_bytes'] / 2**30:7.2f} GiB  ratio {row['measured_over_predicted']:.3f}"
        )
    result = {
        "device": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "model": BENCH_MODEL,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "steps": STEPS,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
