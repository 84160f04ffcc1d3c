"""`hf-scale demo`: the whole product in one command on any machine, GPUs or not.

Generates a 2-process ZeRO-3 config with `hf-scale generate`, checks it with `hf-scale check`, then
fine-tunes the tiny Llama shipped with hf_scale with the generated launch script (`accelerate launch`, gloo
on CPU; the config's batch, precision and optimizer values reach the run through --hf_scale_config), and
prints the per-step loss and where the Hugging Face model was saved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from hf_scale import quiet
from hf_scale.errors import UserError

DEMO_NAME = "zero3_demo"
# A ZeRO-3 config that runs on 2 CPU processes: fp32 and torch's AdamW inside DeepSpeed (its fused
# kernels need a CUDA toolchain). On GPUs drop these for the preset's defaults.
DEMO_OVERRIDES = [
    "topology.processes_per_machine=2",
    "precision='no'",
    "deepspeed.torch_adam=true",
    "batch.micro_batch_size=2",
    "batch.gradient_accumulation_steps=2",
    "optimizer.lr=1e-3",  # a tiny model learns visibly in 20 steps
]


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  hf-scale demo --output-dir outputs/demo --max-steps 20",
    )
    demo.add_argument("--output-dir", default="outputs/demo", metavar="DIR", help="where configs and model go")
    demo.add_argument("--max-steps", type=int, default=20, help="optimizer steps (default 20)")
    demo.add_argument("--loop", choices=["trainer", "accelerate"], default="accelerate", help="training loop")
    demo.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    if args.max_steps < 1:
        raise UserError(f"--max-steps={args.max_steps}: must be >= 1")
    out = Path(args.output_dir).resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is not a directory")
    sets = [arg for item in DEMO_OVERRIDES for arg in ("--set", item)]
    generate = ["generate", "--preset", "zero3", *sets, "--name", DEMO_NAME, "--output-dir", str(out), "--force"]
    code = _hf_scale(generate, args.verbose)
    if code:
        return code
    yaml_path = out / "accelerate_configs" / f"{DEMO_NAME}.yaml"
    # The training args exactly as the launch script below passes them.
    hf_scale_config = out / "hf_scale_configs" / f"{DEMO_NAME}.yaml"
    check = ["check", "--accelerate-config", str(yaml_path), "--", "--hf_scale_config", str(hf_scale_config),
             "--max_steps", str(args.max_steps), "--loop", args.loop]
    code = _hf_scale(check, args.verbose, cwd=out)  # where the launch below starts
    if code:
        return code
    model_dir = out / "model"
    script = out / "launch" / f"{DEMO_NAME}.accelerate.sh"
    command = ["bash", str(script), "--output_dir", str(model_dir), "--max_steps", str(args.max_steps),
               "--loop", args.loop]
    print(f"$ bash {script} --output_dir {model_dir} --max_steps {args.max_steps} --loop {args.loop}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    if args.verbose:
        env[quiet.VERBOSE_ENV] = "1"
    elif not quiet.gpu_device_present():
        # What DeepSpeed picks here anyway, said up front: `accelerate launch` itself (not hf_scale's code) would
        # print DeepSpeed's "Setting accelerator to CPU" notice.
        env.setdefault("DS_ACCELERATOR", "cpu")
    result = subprocess.run(command, env=env)
    if result.returncode != 0:
        print(f"hf-scale demo: training failed (exit {result.returncode})", file=sys.stderr)
        return result.returncode
    print("\nstep  loss")
    for line in (model_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        print(f"{record['step']:>4}  {record['loss']:.4f}")
    print(f"\nmodel saved to {model_dir} (load it with AutoModelForCausalLM.from_pretrained)")
    return 0


def _hf_scale(argv: list[str], verbose: bool, cwd: Path | None = None) -> int:
    """Run `hf-scale ARGV` as a user would (its own process and output; from `cwd`); its exit code. A process,
    not a call into hf_scale.commands.cli: the CLI imports the commands, a command does not import the CLI."""
    print(f"$ hf-scale {' '.join(argv)}", flush=True)
    flags = [quiet.VERBOSE_FLAG] if verbose else []
    return subprocess.run([sys.executable, "-m", "hf_scale", *flags, *argv], cwd=cwd).returncode
