"""Shared by the benchmark scripts: environment record, results files, benchmark models and data, running
train.py and reading its metrics, robust statistics and tables.

The scripts run as ``python benchmarks/NAME.py`` (this directory is then on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_PY = REPO / "train.py"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
WORK_DIR = REPO / "outputs" / "benchmarks"  # models, data and run outputs (git-ignored, rebuilt on demand)

# The embedded tiny Llama's byte-level tokenizer has 264 ids (256 bytes + specials): every character of the
# synthetic data below is one token, so lengths in characters are lengths in tokens.
BYTE_VOCAB = 264

# A Llama-style model a little bigger than the embedded one (3.0M parameters instead of 0.1M), so a CPU step
# takes tens to hundreds of milliseconds and is not dominated by Python overhead.
SMALL_LLAMA = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=BYTE_VOCAB,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
# 11.9M parameters: model states (fp32 weights, gradients, Adam moments: 16 B/parameter = 190 MB under DDP)
# are large enough next to the ~0.5 GB of a Python + torch + DeepSpeed process to show ZeRO's savings.
MEDIUM_LLAMA = dict(SMALL_LLAMA, hidden_size=512, intermediate_size=1376)
# 51M parameters, 2 layers, hidden 1536: per token, the projections and the SwiGLU MLP cost about 6x the
# attention over a ~1,200-token packed row — the balance of a real fine-tune (for a 7-8B model at such
# lengths attention is ~5% of the FLOPs), unlike the 256-wide models above, where attention over the packed
# row costs as much as everything else.
WIDE_LLAMA = dict(SMALL_LLAMA, hidden_size=1536, intermediate_size=4096, num_hidden_layers=2,
                  num_attention_heads=12, num_key_value_heads=4)


def environment() -> dict:
    """What produced a number: versions, device, cores, load at the time, date."""
    import torch

    import hf_scale
    from hf_scale.knowledge.installed import version_of

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hf_scale": hf_scale.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        # The installed distributions' versions, read without importing them (DeepSpeed's import alone takes
        # seconds, and a benchmark that stops early, e.g. gpu.py without a GPU, should not pay it).
        **{name: version_of(name) for name in ("transformers", "accelerate", "deepspeed", "datasets")},
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cuda": torch.version.cuda if cuda else None,
        # Other work on the machine competes for the cores; the 1-minute load average says how much.
        "load_average_at_start": os.getloadavg()[0],
        "host": socket.gethostname(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_results(path: Path, payload: dict) -> Path:
    """Write the results JSON atomically (a crashed run never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def build_llama(config: dict, directory: Path, *, seed: int = 0) -> Path:
    """A randomly initialised Llama of `config` saved with the embedded byte tokenizer (nothing downloaded).

    Reused when the directory already holds the same config, so repeated runs start from identical weights.
    """
    marker = directory / "hf_scale_bench_config.json"
    wanted = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted:
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from hf_scale.train.data.embedded import EMBEDDED_MODEL_DIR

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    model_config = LlamaConfig(
        **config,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(model_config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    marker.write_text(wanted)
    return directory


def _random_text(rng, length: int) -> str:
    # Printable ASCII, one byte = one token.
    return "".join(chr(32 + rng.randrange(95)) for _ in range(length))


def write_fixed_length_text(path: Path, *, rows: int, length: int, seed: int = 0) -> Path:
    """Plain-text rows of exactly `length` characters: every micro-batch has the same shape and no padding, so
    the order the loops visit them in cannot change the work per step."""
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": _random_text(rng, length)}) + "\n")
    return path


# Instruction-tuning-like lengths (in tokens): prompts and responses log-normal, so most examples are short
# and a few are long, like Alpaca/ShareGPT-style SFT sets; total cut at max_seq_length by train.py.
INSTRUCTION_LENGTHS = {
    "prompt": {"median": 40, "sigma": 0.8, "min": 4},
    "response": {"median": 60, "sigma": 1.0, "min": 2},
}


def write_instruction_data(path: Path, *, rows: int, seed: int = 0, scale: float = 1.0) -> Path:
    """Prompt/response rows with INSTRUCTION_LENGTHS (medians multiplied by `scale`)."""
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)

    def draw(spec: dict) -> int:
        return max(spec["min"], round(rng.lognormvariate(math.log(spec["median"] * scale), spec["sigma"])))

    with path.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            row = {
                "instruction": _random_text(rng, draw(INSTRUCTION_LENGTHS["prompt"])),
                "response": _random_text(rng, draw(INSTRUCTION_LENGTHS["response"])),
            }
            f.write(json.dumps(row) + "\n")
    return path


def token_lengths(model_dir: Path, data_file: Path, max_seq_length: int) -> list[int]:
    """Tokenised lengths exactly as train.py sees them (same tokenizer, format detection and truncation)."""
    from transformers import AutoTokenizer

    from hf_scale.contract.data_arguments import DataArguments
    from hf_scale.train.data.pipeline import load_raw_datasets, tokenize_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data_args = DataArguments(train_file=str(data_file), max_seq_length=max_seq_length)
    dataset = tokenize_dataset(load_raw_datasets(data_args)["train"], tokenizer, data_args)
    return [len(ids) for ids in dataset["input_ids"]]


def length_stats(lengths: Sequence[int]) -> dict:
    ordered = sorted(lengths)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "examples": len(ordered),
        "mean": round(statistics.fmean(ordered), 1),
        "median": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": ordered[-1],
    }


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        # Progress bars in captured output are noise.
        TQDM_DISABLE="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


TAIL_LINES = 40
"""Lines of a failed command's stderr printed; its whole stderr is kept in the results."""


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


class CommandFailed(RuntimeError):
    """A benchmark's child process failed. Carries its whole stderr (the real error of a multi-process run is
    often far above the launcher's summary) so a benchmark can keep it in its results (:meth:`record`)."""

    def __init__(self, command: Sequence[str], returncode: int | str, stdout: str, stderr: str):
        self.command = [str(part) for part in command]
        self.returncode = returncode
        self.stdout = stdout or ""
        self.stderr = stderr or ""
        super().__init__(
            f"command failed (exit {returncode}): {' '.join(self.command)}\n"
            f"--- last {TAIL_LINES} lines of its stderr ---\n{tail(self.stderr)}"
        )

    def record(self) -> dict:
        return {"command": self.command, "exit_code": self.returncode, "stderr": self.stderr,
                "stdout_tail": tail(self.stdout, 200)}


def run_checked(command: list[str], *, env: dict, cwd: Path = REPO, timeout: int = 1800) -> str:
    """Run a command; a failure (or timeout) raises CommandFailed with its whole output."""
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        text = [o.decode(errors="replace") if isinstance(o, bytes) else o for o in (expired.stdout, expired.stderr)]
        raise CommandFailed(command, f"timeout after {timeout} s", *text) from None
    if done.returncode != 0:
        raise CommandFailed(command, done.returncode, done.stdout, done.stderr)
    return done.stdout


@contextlib.contextmanager
def failures_recorded(output: Path, benchmark: str):
    """A failed child command ends the benchmark with exit 1 after printing the last lines of its stderr and
    writing the whole of it to OUTPUT_STEM.failed.json (a good results file is never replaced by a failure)."""
    try:
        yield
    except CommandFailed as failure:
        path = output.with_name(f"{output.stem}.failed.json")
        write_results(path, {"benchmark": benchmark, "status": "failed",
                             "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                             "failure": failure.record()})
        print(f"{benchmark}: {failure}\n(whole stderr in {path})", file=sys.stderr)
        raise SystemExit(1) from None


def train_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, str(TRAIN_PY), *args]


def read_metrics(output_dir: Path) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def steady(records: list[dict], warmup: int) -> list[dict]:
    """Drop the first `warmup` optimizer steps (allocator growth, first-call dispatch, lazy inits)."""
    if len(records) <= warmup:
        raise ValueError(f"{len(records)} steps recorded, need more than the {warmup} warm-up steps")
    return records[warmup:]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def alternating(variants: Sequence[str], rep: int) -> list[str]:
    """ABAB...: every other repetition runs the variants in reverse order, so a slow period of the machine
    (other work on the shared cores) does not always hit the same variant first."""
    return list(variants) if rep % 2 == 0 else list(reversed(variants))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)
