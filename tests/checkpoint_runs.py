"""Real training runs that leave checkpoints, shared by tests/export/test_export.py and
tests/train/checkpoint/test_reshard.py, and resuming one of a run's checkpoints in a new directory.

Every run trains 4 optimizer steps and saves `checkpoint-2` and `checkpoint-4` (the global batch is 8 in
all of them: 2 processes x micro 2 x accumulation 2, or 1 process x micro 2 x accumulation 4). Runs are
made once per pytest process (the first test that needs one pays for it) under pytest's temporary
directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from train_helpers import generate_config, launcher_command, read_metrics, run_ok

from hf_scale.contract import checkpoint_layout

STEPS = 4
COMMON = ["--max_steps", str(STEPS), "--save_steps", "2", "--learning_rate", "1e-3", "--seed", "11",
          "--warmup_ratio", "0", "--per_device_train_batch_size", "2", "--loop", "accelerate"]
CPU_2PROC = ["topology.processes_per_machine=2", "deepspeed.torch_adam=true", "precision=no",
             "batch.micro_batch_size=2", "batch.gradient_accumulation_steps=2"]
FSDP_YAML = ("strategy: fsdp\nprecision: 'no'\ntopology: {{processes_per_machine: {procs}}}\n"
             "batch: {{micro_batch_size: 2, gradient_accumulation_steps: {acc}}}\noptimizer: {{lr: 0.001}}\n")

_done: dict[str, Path] = {}


def _root(tmp_path_factory) -> Path:
    root = tmp_path_factory.getbasetemp() / "checkpoint_runs"
    root.mkdir(exist_ok=True)
    return root


def strategy_args(tmp_path_factory, strategy: str, procs: int) -> list[str]:
    """Flags selecting `strategy` (ddp, zero1/2/3, fsdp) for `procs` processes (accumulation keeps batch 8)."""
    root = _root(tmp_path_factory)
    acc = ["--gradient_accumulation_steps", str(4 // procs)]
    if strategy.startswith("zero"):
        configs = root / "ds_configs"
        if not (configs / f"{strategy}.json").is_file():
            generate_config(root, strategy, preset=strategy, sets=CPU_2PROC)
        return acc + ["--deepspeed", str(configs / f"{strategy}.json")]
    if strategy == "fsdp":
        config = root / f"fsdp{procs}.yaml"
        config.write_text(FSDP_YAML.format(procs=procs, acc=4 // procs))
        return acc + ["--hf_scale_config", str(config)]
    return acc


def launcher(strategy: str, procs: int) -> list[str]:
    # DeepSpeed and FSDP2 need a process group even for one process: torchrun provides it.
    if procs == 1 and strategy == "ddp":
        return launcher_command("python")
    return launcher_command("torchrun", nproc=procs)


def trained(tmp_path_factory, strategy: str, procs: int, *, extra: tuple[str, ...] = ()) -> Path:
    """OUTPUT_DIR of a finished run (checkpoint-2, checkpoint-4, final model, metrics.jsonl)."""
    key = f"{strategy}-{procs}{''.join(extra)}"
    if key not in _done:
        out = _root(tmp_path_factory) / key.replace("-", "_").replace(" ", "")
        shutil.rmtree(out, ignore_errors=True)
        run_ok(launcher(strategy, procs) + COMMON + strategy_args(tmp_path_factory, strategy, procs) + list(extra)
               + ["--output_dir", str(out)])
        _done[key] = out
    return _done[key]


def resumed(saved: Path, step: int, out: Path, command: list[str], **kwargs) -> list[dict]:
    """The metrics of `command` resuming `checkpoint-STEP` of run `saved`, copied alone into a new `out`."""
    out.mkdir()
    checkpoint = checkpoint_layout.checkpoint_dir(out, step)
    shutil.copytree(checkpoint_layout.checkpoint_dir(saved, step), checkpoint)
    result = run_ok(command + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"], **kwargs)
    assert f"resuming from {checkpoint}" in result.stderr
    return read_metrics(out)
