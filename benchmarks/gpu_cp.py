"""Context parallelism in train.py against one process: cp=2 must train the one-process run's steps.

    python benchmarks/gpu_cp.py                        # 2+ GPUs: --loop accelerate (torchrun) and trainer
    python benchmarks/gpu_cp.py --loops accelerate     #   (accelerate launch with the generated fsdp2_cp YAML)
    python benchmarks/gpu_cp.py --one-gpu-gloo         # 1 GPU: two ranks on cuda:0 over gloo (see below)
    python benchmarks/gpu_cp.py --cpu-smoke            # no GPU: the script's plumbing (see below)

Every run trains --steps optimizer steps of the embedded tiny Llama (fp32, SDPA) on tests/data/mixture at a global
batch of 8 rows, --max_seq_length 256: one process with micro-batch 8, and cp=2 (FSDP2, dp_shard=1 x cp=2, from
``hf-scale generate --preset fsdp2_cp``) on 2 ranks with micro-batch 8, each rank holding half of every sequence.
The per-step losses and gradient norms (metrics.jsonl) must agree to --rtol (ring attention merges the chunks'
softmax in another order than one SDPA call), the token counts exactly; exit 1 when they do not, or when a run
fails (its whole stderr in the results), 0 when every loop agrees.

Two ranks on one GPU: NCCL refuses them ("Duplicate GPU detected"), so the real check needs 2 GPUs; with one the
script records "not run" and exits 2. --one-gpu-gloo starts the two ranks as two one-process torchrun "machines" that
both use cuda:0, with --ddp_backend gloo (gloo copies CUDA tensors through the host; whether it carries every
collective FSDP2 and the ring attention issue on CUDA tensors is what the run finds out: not tried yet). It can show
the loss rule and the ring attention's numbers on real CUDA kernels; it cannot show speed or memory (both ranks share
one GPU, every collective goes through the host), nor NCCL.

--cpu-smoke (the tests' check of this script): torch's ring attention has no CPU kernel, so dp_shard=2 (FSDP2 over
gloo) stands in for cp=2 in the same pipeline and comparison, and train.py must refuse cp=2 in one line (exit 2)
naming the missing CPU sharding strategy. Writes benchmarks/results/gpu_cp.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import common

RESULTS = common.RESULTS_DIR / "gpu_cp.json"
MIXTURE = common.REPO / "tests" / "data" / "mixture"
GLOBAL_BATCH = 8
CPU_REFUSAL = "aten._scaled_dot_product_flash_attention_for_cpu"


def _flags(args, loop: str) -> list[str]:
    return ["--max_steps", str(args.steps), "--learning_rate", "1e-3", "--seed", "11", "--warmup_ratio", "0",
            "--lr_scheduler_type", "linear", "--max_grad_norm", "1.0", "--max_seq_length", "256",
            "--train_file", str(MIXTURE / "qa.jsonl"), str(MIXTURE / "chat.jsonl"), "--mixture_weights", "0.75",
            "0.25", "--loop", loop, "--disable_tqdm", "true"]


def _generate(workdir: Path, layout_sets: list[str]) -> Path:
    """`hf-scale generate --preset fsdp2_cp` for 2 ranks: its hf_scale config and accelerate launch file."""
    out = workdir / "generated"
    sets = ["topology.processes_per_machine=2", "precision=no", "optimizer.lr=0.001", *layout_sets]
    common.run_checked([sys.executable, "-m", "hf_scale", "generate", "--preset", "fsdp2_cp",
                        *[part for s in sets for part in ("--set", s)], "--name", "cp", "--output-dir", str(out),
                        "--force"], env=common.child_env(1))
    return out


def _reference(args, loop: str, out: Path, env: dict) -> list[dict]:
    common.run_checked(common.train_command([*_flags(args, loop), "--per_device_train_batch_size",
                                             str(GLOBAL_BATCH), "--output_dir", str(out)]), env=env, timeout=1800)
    return common.read_metrics(out)


def _two_ranks(args, loop: str, generated: Path, out: Path, env: dict) -> list[dict]:
    flags = [*_flags(args, loop), "--output_dir", str(out)]
    config = generated / "hf_scale_configs" / "cp.yaml"
    if loop == "trainer":  # the generated launch file: accelerate launch with the YAML's FSDP and parallelism_config
        launch_env = {**env, "TRAIN_SCRIPT": str(common.TRAIN_PY), "MAIN_PROCESS_PORT": str(common.free_port()),
                      "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        common.run_checked(["bash", str(generated / "launch" / "cp.accelerate.sh"), *flags], env=launch_env,
                           timeout=1800)
    elif args.one_gpu_gloo:  # two one-process "machines" on one host: both ranks get LOCAL_RANK 0, i.e. cuda:0
        port = str(common.free_port())
        commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
                     "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, str(common.TRAIN_PY),
                     *flags, "--hf_scale_config", str(config), "--ddp_backend", "gloo"] for rank in (0, 1)]
        processes = [subprocess.Popen(c, cwd=common.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for c in commands]
        for command, process in zip(commands, processes, strict=True):
            stdout, stderr = process.communicate(timeout=1800)
            if process.returncode:
                raise common.CommandFailed(command, process.returncode, stdout, stderr)
    else:
        common.run_checked([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(common.free_port()), str(common.TRAIN_PY), *flags, "--hf_scale_config", str(config)],
                           env=env, timeout=1800)
    return common.read_metrics(out)


def compare(one: list[dict], two: list[dict], rtol: float) -> list[str]:
    """Where the two-rank run differs from one process (empty: the same steps)."""
    problems = []
    if [r["step"] for r in two] != [r["step"] for r in one] or not one:
        return [f"steps {[r['step'] for r in two]} against {[r['step'] for r in one]}"]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm"):
            if abs(b[key] - a[key]) > rtol * abs(a[key]):
                problems.append(f"step {a['step']}: {key} {b[key]!r} against one process's {a[key]!r}")
        if b["tokens"] != a["tokens"]:
            problems.append(f"step {a['step']}: {b['tokens']} tokens against one process's {a['tokens']}")
    return problems


def _cpu_refusal(args, generated: Path, env: dict) -> str:
    """train.py's one line for cp=2 on this CPU machine (exit 2 expected)."""
    done = subprocess.run(common.train_command([*_flags(args, "accelerate"), "--output_dir",
                                                str(args.workdir / "refused"), "--hf_scale_config",
                                                str(generated / "hf_scale_configs" / "cp.yaml")]),
                          cwd=common.REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line.startswith("train.py: error:")]
    if done.returncode != 2 or len(lines) != 1 or CPU_REFUSAL not in lines[0]:
        raise common.CommandFailed(done.args, done.returncode, done.stdout, done.stderr)
    return lines[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--loops", nargs="+", choices=("accelerate", "trainer"), default=["accelerate", "trainer"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance of losses and gradient norms")
    parser.add_argument("--one-gpu-gloo", action="store_true", help="two ranks on cuda:0 over gloo (manual loop)")
    parser.add_argument("--cpu-smoke", action="store_true", help="no GPU: dp_shard=2 stands in for cp=2")
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "gpu_cp")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    environment = common.environment()
    need = 1 if args.one_gpu_gloo else 2
    if not args.cpu_smoke and gpus < need:
        reason = (f"{gpus} CUDA GPU(s) visible; cp=2 needs {need} (NCCL refuses two ranks on one device: see "
                  "--one-gpu-gloo; --cpu-smoke checks the script without a GPU)")
        common.write_results(args.output, {"benchmark": "gpu_cp", "status": "not run", "reason": reason,
                                           "environment": environment})
        print(f"gpu_cp.py: error: {reason}; recorded 'not run' in {args.output}", file=sys.stderr)
        return 2
    loops = ["accelerate"] if args.cpu_smoke or args.one_gpu_gloo else args.loops
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    env = common.child_env(1)
    results: dict = {}
    with common.failures_recorded(args.output, "gpu_cp"):
        generated = _generate(args.workdir, ["parallelism.cp=2", f"batch.micro_batch_size={GLOBAL_BATCH}",
                                             "batch.gradient_accumulation_steps=1"])
        stand_in = None
        if args.cpu_smoke:
            results["cp_refused_on_cpu"] = _cpu_refusal(args, generated, env)
            # dp_shard=2: micro-batch 4 on each of 2 data-parallel ranks is the global batch of 8.
            stand_in = _generate(args.workdir / "stand_in", ["parallelism.cp=1", "batch.micro_batch_size=4",
                                                             "batch.gradient_accumulation_steps=1"])
        for loop in loops:
            one = _reference(args, loop, args.workdir / f"one-{loop}", env)
            two = _two_ranks(args, loop, stand_in or generated, args.workdir / f"two-{loop}", env)
            problems = compare(one, two, args.rtol)
            results[loop] = {"layout": "dp_shard=2 (stand-in)" if stand_in else "cp=2", "problems": problems,
                             "one_process": one, "two_ranks": two}
            print(f"{loop}: {'equal' if not problems else 'DIFFERENT: ' + '; '.join(problems)}")
    status = "cpu smoke (not a measurement)" if args.cpu_smoke else "ok"
    if any(results[loop]["problems"] for loop in loops):
        status = "mismatch"
    common.write_results(args.output, {"benchmark": "gpu_cp", "status": status, "environment": environment,
                                       "setup": {"steps": args.steps, "rtol": args.rtol, "gpus": gpus,
                                                 "one_gpu_gloo": args.one_gpu_gloo}, "results": results})
    print(f"wrote {args.output}")
    print(json.dumps({loop: results[loop]["problems"] for loop in loops}))
    return 1 if status == "mismatch" else 0


if __name__ == "__main__":
    sys.exit(main())
