"""Shared by the train.py tests: launching real processes and reading what they wrote."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN_PY = str(REPO / "train.py")
LAUNCH_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(tmp_cache: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",  # 2 cores, 2 ranks
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    if tmp_cache is not None:
        env["HF_DATASETS_CACHE"] = str(tmp_cache)
    return env


def torchrun(script, *args, nproc: int = 2) -> list[str]:
    """`torchrun --nproc_per_node N --master_port FREE script args...` with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), str(script), *map(str, args)]


def launcher_command(launcher: str, nproc: int = 2, *, config: Path | None = None) -> list[str]:
    """The command prefix for `python`, `torchrun`, `accelerate` (needs config) or `deepspeed`."""
    if launcher == "python":
        return [sys.executable, TRAIN_PY]
    if launcher == "torchrun":
        return torchrun(TRAIN_PY, nproc=nproc)
    if launcher == "accelerate":
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(free_port()),
            TRAIN_PY,
        ]
    if launcher == "deepspeed":
        return [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(nproc),
            "--master_port",
            str(free_port()),
            TRAIN_PY,
        ]
    raise ValueError(launcher)


def run(
    command: list[str], *, cwd: Path = REPO, env: dict | None = None, timeout: int = LAUNCH_TIMEOUT_S
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=cwd, env=env or child_env(), capture_output=True, text=True, timeout=timeout
    )


def run_ok(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = run(command, **kwargs)
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    return result


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+', re.MULTILINE)


def training_traceback_frames(output: str) -> list[str]:
    """The Python traceback frames in `output` that are in train.py or the hf_scale package: a refusal of
    train.py must be one line, not a traceback. A launcher's own report (torchrun's ChildFailedError
    traceback, its summary naming the script) is not one of train.py's. Paths are compared resolved, so the
    answer does not depend on where the repository is cloned (a clone folder named `hf_scale` included)."""
    package = (REPO / "hf_scale").resolve()
    ours = []
    for match in _FRAME.finditer(output):
        path = Path(match["path"]).resolve()
        if path == Path(TRAIN_PY).resolve() or path.is_relative_to(package):
            ours.append(match.group(0).strip())
    return ours


LIBRARY_NOISE = (
    "Gradient accumulation steps mismatch",  # accelerate, when the Trainer runs DeepSpeed with accumulation
    "'pin_memory' argument is set as true but no accelerator is found",  # torch's DataLoader on a CPU machine
)
DEEPSPEED_NO_GPU_NOTICE = "Setting accelerator to CPU"


def assert_quiet(result: subprocess.CompletedProcess, steps: int, launcher: str = "python") -> None:
    """train.py's output without the libraries' known noise (hf_scale.quiet), and the finished progress bar
    printed once: no other output (a save's bars) between its renderings. The launchers' own processes are not
    train.py's: `accelerate launch` (DeepSpeed configs) imports DeepSpeed, which prints its notice once; the
    deepspeed launcher twice (its runner and the per-node launch process it starts)."""
    output = result.stdout + result.stderr
    assert not [noise for noise in LIBRARY_NOISE if noise in output], output[-3000:]
    notices = [line for line in output.splitlines() if DEEPSPEED_NO_GPU_NOTICE in line]
    assert len(notices) <= {"accelerate": 1, "deepspeed": 2}.get(launcher, 0), notices
    # Text-mode output turns a progress bar's carriage returns into line ends: each rendering is a line.
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    finished = [i for i, line in enumerate(lines) if re.search(rf"100%\|.*\| {steps}/{steps} \[", line)]
    assert finished and finished == list(range(finished[0], finished[-1] + 1)), "\n".join(lines[finished[0]:])


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def read_metrics(output_dir: Path) -> list[dict]:
    """The per-optimizer-step records (eval records, which carry eval_loss instead of loss, left out)."""
    return [record for record in _records(output_dir) if "loss" in record]


def read_eval_metrics(output_dir: Path) -> list[dict]:
    return [record for record in _records(output_dir) if "eval_loss" in record]


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir)]


def generate_config(
    out_dir: Path, name: str, *, preset: str, sets: list[str], extra: tuple[str, ...] = ()
) -> Path:
    """`hf-scale generate` into out_dir (the real CLI in a subprocess); returns out_dir."""
    command = [
        sys.executable,
        "-m",
        "hf_scale.cli",
        "generate",
        "--preset",
        preset,
        "--name",
        name,
        "--output-dir",
        str(out_dir),
        *extra,
    ]
    for item in sets:
        command += ["--set", item]
    run_ok(command, timeout=120)
    return out_dir


def assert_saved_model_reproduces(output_dir: Path) -> None:
    """Load the saved directory with plain from_pretrained and compare with the trained model's logits."""
    from transformers import AutoModelForCausalLM

    report = json.loads((Path(output_dir) / "hf_scale_verify.json").read_text())
    assert report["ok"], report
    probe = torch.load(Path(output_dir) / "hf_scale_verify.pt")
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert (Path(output_dir) / "model.safetensors").is_file() or (
        Path(output_dir) / "model.safetensors.index.json"
    ).is_file()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
