"""Shared by the train.py tests: launching real processes and reading what they wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import preloaded
import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN_PY = str(REPO / "train.py")
LAUNCH_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What an in-process test may leave in os.environ: train.py run in process (the bad-input corpus) sets a
# single-process rendezvous for DeepSpeed and keeps its TCPStore listening on MASTER_PORT; a child launched with
# that environment would try to listen on the same port (EADDRINUSE). Launchers set these for their children.
_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                   "GROUP_RANK", "ROLE_RANK", "ACCELERATE_USE_DEEPSPEED")


def child_env(tmp_cache: Path | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _RENDEZVOUS_ENV}
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


# C, C++ and CUDA compilers, also versioned/target-prefixed (gcc-12, x86_64-linux-gnu-g++, clang++-17).
COMPILER = re.compile(r"^(?:[\w.]+-)*?(?:gcc|g\+\+|cc|c\+\+|clang|clang\+\+|nvcc)(?:-[\d.]+)?$")
SHM_COMM_OP = "deepspeed_shm_comm"


def path_without_compilers(directory: Path) -> str:
    """A PATH of links to every program on PATH (and next to this interpreter) except compilers. ninja stays:
    on a machine without GPUs DeepSpeed loads its shared-memory comm op through torch's JIT loader, which
    runs ninja even when the build is cached (it then compiles nothing)."""
    return path_without(directory, COMPILER)


def path_without(directory: Path, left_out: re.Pattern) -> str:
    """A PATH of links to every program on PATH (and next to this interpreter) whose name ``left_out`` does not
    match: a machine without those programs."""
    directory.mkdir(parents=True, exist_ok=True)
    folders = [os.path.dirname(sys.executable), *os.environ.get("PATH", "").split(os.pathsep)]
    for folder in filter(os.path.isdir, folders):
        if "shims" in Path(folder).parts:  # pyenv shims re-add the interpreter's folder to PATH
            continue
        for entry in os.scandir(folder):
            target = directory / entry.name
            if left_out.match(entry.name) or target.exists() or not os.access(entry.path, os.X_OK):
                continue
            if entry.is_file():
                target.symlink_to(os.path.realpath(entry.path))
    return str(directory)


def prebuilt_shm_comm_op(extensions_dir: Path) -> Path:
    """TORCH_EXTENSIONS_DIR holding only DeepSpeed's CPU comm op, built (or found in torch's default cache)
    with the compiler, as a node would have it from an earlier run or a prebuilt DeepSpeed."""
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "from torch.utils.cpp_extension import _get_build_directory\n"
            f"get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)\n"
            f"print(_get_build_directory('{SHM_COMM_OP}', False))")
    env = {k: v for k, v in child_env().items() if k != "TORCH_EXTENSIONS_DIR"}
    built = run_ok([sys.executable, "-c", code], env=env, timeout=600).stdout.strip().splitlines()[-1]
    shutil.copytree(built, extensions_dir / SHM_COMM_OP, dirs_exist_ok=True)
    return extensions_dir


def no_compiler_env(no_compiler_path: str, extensions_dir: Path) -> dict[str, str]:
    """child_env() without any compiler on PATH, CC/CXX unset, JIT builds cached in `extensions_dir`, and
    the TORCH_CUDA_ARCH_LIST of Hopper images that DeepSpeed's JIT builder cannot parse."""
    env = {k: v for k, v in child_env().items() if k not in ("CC", "CXX")}
    env.update(PATH=no_compiler_path, TORCH_EXTENSIONS_DIR=str(extensions_dir), TORCH_CUDA_ARCH_LIST="9.0a")
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
    command: list[str], *, cwd: Path = REPO, env: dict | None = None, timeout: int = LAUNCH_TIMEOUT_S,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """`command` to its end: `python train.py`, `torchrun ... train.py`, `accelerate launch ... train.py` and the
    same of a worker script under tests/ start from the preloaded fork server (tests/preloaded.py) where they can,
    everything else as a subprocess. `file_size_limit` (bytes): RLIMIT_FSIZE of the command and everything it starts,
    a real limit standing in for a full disk (the kernel refuses a bigger file: EFBIG; Python ignores SIGXFSZ)."""
    env = env or child_env()
    preloaded_result = preloaded.run(command, cwd=cwd, env=env, timeout=timeout, train_py=TRAIN_PY,
                                     server_env=child_env(), file_size_limit=file_size_limit)
    if preloaded_result is not None:
        return preloaded_result
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=None if file_size_limit is None else lambda: preloaded.limit_file_size(
                              file_size_limit))


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
        "hf_scale.commands.cli",
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


# A fixed probe for comparing saved models (byte tokens of the embedded tiny Llama's vocabulary).
PROBE_IDS = torch.tensor([[1, 76, 105, 107, 101, 32, 97, 32, 112, 114, 111, 98, 101, 46, 2]])


def logits(model_dir: Path, input_ids: torch.Tensor = PROBE_IDS) -> torch.Tensor:
    """Logits of a saved directory loaded with plain from_pretrained (a LoRA adapter through peft)."""
    if (Path(model_dir) / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM as auto_class
    else:
        from transformers import AutoModelForCausalLM as auto_class
    model = auto_class.from_pretrained(model_dir)
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def assert_saved_model_verified(output_dir: Path, *, like: Path | None = None, atol: float = 1e-4) -> dict:
    """train.py's own save check passed (tensor by tensor, exact), and — the test's independent proof — the
    directory loads with plain from_pretrained and, given `like` (another run's saved model, e.g. the
    one-process reference that trained identically), computes the same logits."""
    report = json.loads((Path(output_dir) / "hf_scale_verify.json").read_text())
    assert report["ok"] and report["tensors_checked"] == report["tensors_expected"] > 0, report
    assert (Path(output_dir) / "model.safetensors").is_file() or (
        Path(output_dir) / "model.safetensors.index.json"
    ).is_file()
    got = logits(output_dir)
    if like is not None:
        torch.testing.assert_close(got, logits(like), rtol=1e-4, atol=atol)
    return report


def run_in_process(argv: list[str]) -> int:
    """`python train.py ARGV` inside this process (no ~6 s of imports per run): the exit code.

    For runs that need no process group of several ranks. Everything train.py changes in the process (the
    environment, its signal handlers, accelerate's and DeepSpeed's global state) is put back afterwards.
    """
    import signal

    from accelerate.state import AcceleratorState, PartialState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from hf_scale.train import main

    environ = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    os.environ.update(child_env())
    try:
        main.main(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
        unset_hf_deepspeed_config()
    raise AssertionError("train.py's main() returned instead of exiting")


def tree(path: Path) -> dict[str, bytes] | None:
    """Every file under `path` with its content (None when `path` does not exist): to prove nothing changed."""
    path = Path(path)
    if not path.exists():
        return None
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def assert_live_values(output_dir: Path, config_path: Path) -> dict:
    """OUTPUT_DIR/hf_scale_live.json (read from the running Trainer/Accelerator/DeepSpeed engine at the first
    optimizer step) holds every value of the DistributedConfig the run was launched with."""
    from hf_scale.config.distributed_config import load_config

    cfg = load_config(config_path)
    live = json.loads((Path(output_dir) / "hf_scale_live.json").read_text())
    batch, opt = cfg.batch, cfg.optimizer
    expected = {
        "world_size": cfg.world_size,
        "precision": cfg.precision,
        "gradient_clipping": cfg.gradient_clipping,
        "activation_checkpointing": cfg.activation_checkpointing,
        "batch": {"micro_batch_size": batch.micro_batch_size,
                  "gradient_accumulation_steps": batch.gradient_accumulation_steps,
                  "global_batch_size": batch.global_batch_size},
        "optimizer": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay},
    }
    assert {key: live[key] for key in expected} == expected
    if cfg.strategy == "deepspeed":
        assert live["deepspeed"] == {
            "zero_stage": cfg.deepspeed.zero_stage, "micro_batch_size": batch.micro_batch_size,
            "gradient_accumulation_steps": batch.gradient_accumulation_steps,
            "train_batch_size": batch.global_batch_size, "gradient_clipping": cfg.gradient_clipping,
            "precision": cfg.precision,
        }
    else:
        assert live["deepspeed"] is None
    return live


def tiny_moe(*, seed: int = 0, **overrides):
    """A tiny Qwen3-MoE (4 experts, 2 active per token, fp32) with the embedded tokenizer's vocabulary: transformers
    keeps its experts fused at run time and saves them per expert. ``overrides`` are further config values (e.g.
    output_router_logits=True for the router's aux loss)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hf_scale.train.data.embedded import MAX_POSITION_EMBEDDINGS, build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=-(-len(tokenizer) // 8) * 8, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=MAX_POSITION_EMBEDDINGS, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).to(torch.float32), tokenizer


def build_tiny_moe(out_dir: Path, **overrides) -> Path:
    """`tiny_moe(**overrides)` saved with its tokenizer, as a user's local model directory."""
    model, tokenizer = tiny_moe(**overrides)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def stale_lock(root: Path, op: str = "cpu_adam", age_s: int = 2 * 3600) -> Path:
    """What a run killed while torch JIT-built ``op`` leaves: ROOT/OP/lock (torch's FileBaton), nobody holding it."""
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock

