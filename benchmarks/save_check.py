"""Cost of train.py's save check (hf_scale/train/checkpoint/save.py) on a model with TinyLlama-1.1B's shapes, on CPU.

    python benchmarks/save_check.py                       # fp32 and bf16 saves, one file each
    python benchmarks/save_check.py --dtypes bf16 --max-shard-size 1GB

Each dtype runs in a fresh process (so peak memory is its own): a randomly initialised model of TinyLlama-1.1B's
shapes (nothing downloaded) is saved with ``save_pretrained`` (safetensors), then ``verify_saved_model`` compares
every saved tensor with the live one, exactly. Reported: seconds, bytes read, the largest tensor, resident memory
before the check and its peak during the check (the kernel's VmHWM, reset just before), so the check's own
host-memory cost is peak - before. For comparison, the design it replaced — reload the whole directory with
``from_pretrained`` in another process and run a 16-token forward pass — is measured in a fresh process too.
Results go to benchmarks/results/save_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import common

TINYLLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
RESULTS = Path(__file__).resolve().parent / "results" / "save_check.json"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _check_worker(dtype: str, out_dir: Path, max_shard_size: str, result_file: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_scale.train.checkpoint.save import verify_saved_model

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**TINYLLAMA_1B))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.to(getattr(torch, DTYPES[dtype]))
    started = time.perf_counter()
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    save_seconds = time.perf_counter() - started
    report = verify_saved_model(out_dir, model, is_main_process=True)
    parameters = sum(p.numel() for p in model.parameters())
    result_file.write_text(json.dumps({"parameters": parameters, "save_seconds": round(save_seconds, 2), **report}))


def _reload_worker(out_dir: Path, result_file: Path) -> None:
    """The replaced design: reload on the CPU (fp32, as the old check did) and run a 16-token forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_scale.train.checkpoint.save import _peak_rss

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    with torch.no_grad():
        model(input_ids=torch.arange(16).unsqueeze(0))
    result_file.write_text(json.dumps({"seconds": round(time.perf_counter() - started, 2),
                                       "peak_host_rss_bytes": _peak_rss()}))


def _child(args: list[str], threads: int) -> dict:
    result_file = Path(args[args.index("--result") + 1])
    common.run_checked([sys.executable, __file__, *args], env=common.child_env(threads), timeout=3600)
    return json.loads(result_file.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--max-shard-size", default="50GB", help="save_pretrained's (default 50GB: one file)")
    parser.add_argument("--no-reload-baseline", action="store_true", help="skip the replaced design's measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "save_check")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=("check", "reload"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "check":
        _check_worker(args.dtype, args.dir, args.max_shard_size, args.result)
        return 0
    if args.worker == "reload":
        _reload_worker(args.dir, args.result)
        return 0

    environment = common.environment()
    runs = {}
    with common.failures_recorded(args.output, "save_check"):
        for dtype in args.dtypes:
            model_dir = args.workdir / dtype
            check = _child(["--worker", "check", "--dtype", dtype, "--dir", str(model_dir), "--max-shard-size",
                            args.max_shard_size, "--result", str(args.workdir / f"{dtype}.json")], args.threads)
            assert check["ok"], check["problems"]
            reload = None if args.no_reload_baseline else _child(
                ["--worker", "reload", "--dir", str(model_dir), "--result", str(args.workdir / f"{dtype}-reload.json")],
                args.threads)
            runs[dtype] = {"check": check, "reload_baseline": reload}
            extra = check["peak_host_rss_bytes"] - check["rss_before_bytes"]
            print(f"{dtype}: {check['tensors_checked']} tensors, {check['bytes_read'] / 1e9:.2f} GB read in "
                  f"{check['seconds']:.1f} s ({check['bytes_read'] / 1e9 / check['seconds']:.2f} GB/s); host memory "
                  f"+{extra / 2**20:.0f} MiB over the {check['rss_before_bytes'] / 2**30:.1f} GiB process (largest "
                  f"tensor {check['largest_tensor_bytes'] / 2**20:.0f} MiB)"
                  + (f"; old design: reload + forward {reload['seconds']:.1f} s, peak "
                     f"{reload['peak_host_rss_bytes'] / 2**30:.1f} GiB" if reload else ""), flush=True)
    payload = {
        "benchmark": "save_check",
        "environment": environment,
        "setup": {"model": dict(TINYLLAMA_1B, parameters=next(iter(runs.values()))["check"]["parameters"]),
                  "init": "random (normal, std 0.02)", "max_shard_size": args.max_shard_size,
                  "threads": args.threads, "device": "cpu"},
        "runs": runs,
    }
    common.write_results(args.output, payload)
    for dtype in args.dtypes:
        for name in (dtype, f"{dtype}-reload"):
            Path(args.workdir, f"{name}.json").unlink(missing_ok=True)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
