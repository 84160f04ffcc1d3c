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

The DeepSpeed candidates run the JSON `hf-scale generate` writes: without optimizer offload it has no
`optimizer` block and the loop's fused torch AdamW is handed to ``deepspeed.initialize`` (as train.py does), so
nothing is JIT-compiled; the offload candidate needs DeepSpeedCPUAdam, checked before it is launched. A failed
candidate keeps its whole stderr in the results and its last lines are printed; the others still run.

    python benchmarks/planner_gpu_memory.py --cpu-smoke --output /tmp/smoke.json   # no GPU: the same pipeline
    on a tiny model over gloo, one process per candidate; proves the script works, measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import common

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
# --cpu-smoke: the same code path in seconds (no claim about memory).
SMOKE_MODEL = dict(BENCH_MODEL, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=264, max_position_embeddings=512)
DEFAULT_CANDIDATES = ["ddp", "zero1", "zero2", "zero3", "zero3_offload_opt", "fsdp2_full_shard", "zero2_ac", "zero3_ac"]
RESULTS = Path(__file__).resolve().parent / "results" / "planner_gpu_memory.json"
SMOKE_RESULTS = common.WORK_DIR / "planner_gpu_memory.cpu_smoke.json"
STEPS = 3


def _model_config(smoke: bool) -> dict:
    return SMOKE_MODEL if smoke else BENCH_MODEL


def _plan(gpus: int, seq_len: int, micro_batch: int, smoke: bool = False):
    from transformers import LlamaConfig

    from hf_scale.planner import Workload, make_plan, model_shapes

    shapes = model_shapes(LlamaConfig(**_model_config(smoke)), name="bench-llama-0.85b")
    workload = Workload(shapes, gpus_per_machine=gpus, num_machines=1, seq_len=seq_len, micro_batch_size=micro_batch)
    return make_plan(workload, gpu_memory=10**15)  # everything "fits": we only want the estimates


def _deepspeed_json(plan, assessment, hidden: int) -> dict:
    from hf_scale.contract.deepspeed_json import deepspeed_config
    from hf_scale.planner import distributed_config

    ds = deepspeed_config(distributed_config(plan, assessment), "resolved")
    zero = ds["zero_optimization"]
    # The values the HF Trainer fills for "auto" (the planner assumes them).
    zero["reduce_bucket_size"] = hidden * hidden
    if assessment.candidate.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        zero["stage3_param_persistence_threshold"] = 10 * hidden
    return ds


def _worker(slug: str, seq_len: int, micro_batch: int, out: Path, smoke: bool) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if smoke else torch.device("cuda", local_rank)
    if not smoke:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo" if smoke else "nccl")
    world = dist.get_world_size()
    plan = _plan(world, seq_len, micro_batch, smoke)
    assessment = next(a for a in plan.assessments if a.slug == slug)
    candidate, predicted = assessment.candidate, assessment.estimate
    torch.manual_seed(0)
    config = LlamaConfig(**_model_config(smoke))
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    if candidate.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if candidate.engine == "deepspeed":
        import deepspeed

        ds = _deepspeed_json(plan, assessment, config.hidden_size)
        # No optimizer block (no offload): the loop's fused torch AdamW, as train.py runs it.
        optimizer = None if "optimizer" in ds else torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds, optimizer=optimizer,
                                               model_parameters=model.parameters())

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
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if smoke else [local_rank])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step(ids):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=candidate.engine == "ddp"):
                loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    generator = torch.Generator(device=device).manual_seed(local_rank)
    if not smoke:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device, generator=generator)
        step(ids)
    if smoke:
        import resource

        measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # host memory: no claim
    else:
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


def _ops_problems(slug: str, gpus: int, seq_len: int, micro_batch: int, smoke: bool) -> list[str]:
    """The DeepSpeed ops this candidate's JSON would load, where they cannot load here (one line each)."""
    from hf_scale.knowledge.deepspeed_ops import check_config_ops

    plan = _plan(gpus, seq_len, micro_batch, smoke)
    assessment = next((a for a in plan.assessments if a.slug == slug), None)
    if assessment is None:
        return [f"{slug}: not a planner candidate (see hf-scale plan)"]
    if assessment.candidate.engine != "deepspeed":
        return []
    ds = _deepspeed_json(plan, assessment, _model_config(smoke)["hidden_size"])
    return check_config_ops(ds, slug, gpu=not smoke)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="processes/GPUs (default: all visible; smoke: 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; smoke: 64)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--candidates", nargs="+", default=DEFAULT_CANDIDATES, metavar="SLUG")
    parser.add_argument("--output", type=Path, default=None, help=f"results JSON (default {RESULTS}; smoke: "
                        f"{SMOKE_RESULTS})")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU needed: the same pipeline on a tiny model over gloo (measures nothing)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per candidate (default 1800)")
    parser.add_argument("--worker", metavar="SLUG", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    smoke = args.cpu_smoke
    seq_len = args.seq_len or (64 if smoke else 4096)
    if args.worker:
        _worker(args.worker, seq_len, args.micro_batch, args.worker_out, smoke)
        return 0

    import torch

    if not smoke and not torch.cuda.is_available():
        print("planner_gpu_memory: no CUDA GPU visible; this benchmark needs one (or run --cpu-smoke)",
              file=sys.stderr)
        return 2
    gpus = args.gpus or (1 if smoke else torch.cuda.device_count())
    output = args.output or (SMOKE_RESULTS if smoke else RESULTS)
    rows = [_run_candidate(slug, gpus, seq_len, args) for slug in args.candidates]
    result = {
        "status": "cpu smoke (not a measurement)" if smoke else "ok",
        "environment": common.environment(),
        "gpus": gpus,
        "model": _model_config(smoke),
        "seq_len": seq_len,
        "micro_batch": args.micro_batch,
        "steps": STEPS,
        "rows": rows,
    }
    common.write_results(output, result)
    print(f"wrote {output}")
    return 1 if any("error" in row for row in rows) else 0


def _run_candidate(slug: str, gpus: int, seq_len: int, args) -> dict:
    """One candidate in a fresh torchrun job; a failure is a row with its whole stderr (and its last lines printed)."""
    smoke = args.cpu_smoke
    problems = _ops_problems(slug, gpus, seq_len, args.micro_batch, smoke)
    if problems:
        print(f"{slug:32s} NOT RUN: {'; '.join(problems)}")
        return {"candidate": slug, "error": {"not_run": problems}}
    with tempfile.TemporaryDirectory() as tmp:
        row_path = Path(tmp) / "row.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
            __file__, "--worker", slug, "--worker-out", str(row_path),
            "--seq-len", str(seq_len), "--micro-batch", str(args.micro_batch),
        ] + (["--cpu-smoke"] if smoke else [])  # fmt: skip
        try:
            common.run_checked(command, env=dict(os.environ), timeout=args.timeout)
            if not row_path.exists():
                raise common.CommandFailed(command, 0, "", "the worker wrote no result row")
        except common.CommandFailed as failure:
            print(f"{slug:32s} FAILED (exit {failure.returncode}); last lines of its stderr:\n"
                  f"{common.tail(failure.stderr)}", flush=True)
            return {"candidate": slug, "error": failure.record()}
        row = json.loads(row_path.read_text())
    deviation = abs(row["measured_over_predicted"] - 1)
    if not smoke:
        row["within_10_percent"], row["within_5_percent"] = deviation <= 0.10, deviation <= 0.05
    print(
        f"{slug:32s} predicted {row['predicted_bytes'] / 2**30:7.2f} GiB  measured "
        f"{row['measured_peak_allocated_bytes'] / 2**30:7.2f} GiB  ratio {row['measured_over_predicted']:.3f}",
        flush=True,
    )
    return row


if __name__ == "__main__":
    sys.exit(main())
