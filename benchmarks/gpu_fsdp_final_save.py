"""GPU check: the Trainer loop's final save under FSDP's SHARDED_STATE_DICT holds the trained weights.

    python benchmarks/gpu_fsdp_final_save.py [--output fsdp_final_save.json] [--dry-run]

transformers' `Trainer.save_model` writes weights under FSDP only for FULL_STATE_DICT; HfScaleTrainer.save_model
(hf_scale/train/loops/trainer.py) gathers the model itself for any other type, as the manual loop does. That branch
runs only where accelerate runs FSDP, on GPUs: accelerate's AcceleratorState turns the distributed type into FSDP
(and keeps the plugin the Trainer's `is_fsdp_enabled` reads) only for MULTI_GPU-like types (accelerate/state.py),
so on a CPU-only machine the plugin is dropped and train.py's guard refuses the run
(tests/train/setup/test_guard.py). Hence this script, not a pytest test.

It launches train.py with `accelerate launch` and TRL's FSDP2 accelerate config from the test corpus
(tests/data/peer_configs/trl_fsdp2.yaml, SHARDED_STATE_DICT, verbatim but for num_processes = the GPUs here and
mixed_precision 'no' so that the comparison is exact), `--loop trainer --max_steps 4 --save_steps 4`, then exports
the step-4 checkpoint's own FSDP shards with `hf-scale export` and compares every tensor of the final
OUTPUT_DIR/model.safetensors with the export: equal, bit for bit, is the proof (the checkpoint holds the trained
model at the last step; train.py's own save check compares the final save with the live model too). Without a GPU
it writes a "not run" record and exits 1 in one line; `--dry-run` writes the launch config and prints the commands
(tests/test_benchmarks_smoke.py runs that on CPU and has accelerate parse the config).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import common
import yaml

CORPUS_YAML = common.REPO / "tests" / "data" / "peer_configs" / "trl_fsdp2.yaml"
STEPS = 4


def launch_config(path: Path, processes: int) -> Path:
    config = yaml.safe_load(CORPUS_YAML.read_text())
    assert config["fsdp_config"]["fsdp_state_dict_type"] == "SHARDED_STATE_DICT", CORPUS_YAML
    config.update(num_processes=processes, mixed_precision="no")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def commands(config: Path, out: Path, exported: Path) -> list[list[str]]:
    train = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
             "--main_process_port", str(common.free_port()), str(common.TRAIN_PY),
             "--loop", "trainer", "--max_steps", str(STEPS), "--save_steps", str(STEPS),
             "--per_device_train_batch_size", "2", "--output_dir", str(out)]
    export = [sys.executable, "-m", "hf_scale", "export", str(out / f"checkpoint-{STEPS}"), str(exported)]
    return [train, export]


def compare(final: Path, exported: Path) -> dict:
    from safetensors.torch import load_file

    saved, reference = load_file(final / "model.safetensors"), load_file(exported / "model.safetensors")
    differing = sorted(name for name in reference if name not in saved or not saved[name].equal(reference[name]))
    return {"tensors": len(reference), "differing": differing, "extra": sorted(set(saved) - set(reference))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=common.RESULTS_DIR / "gpu_fsdp_final_save.json")
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "fsdp_final_save")
    parser.add_argument("--dry-run", action="store_true", help="write the launch config, print the commands")
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    config = launch_config(args.workdir / "fsdp2.yaml", max(gpus, 1))
    out, exported = args.workdir / "out", args.workdir / "exported"
    planned = commands(config, out, exported)
    if args.dry_run:
        for command in planned:
            print(" ".join(command))
        return 0
    record = {"environment": common.environment(), "config": str(CORPUS_YAML.relative_to(common.REPO))}
    if gpus == 0:
        common.write_results(args.output, {**record, "not_run": "no GPU: accelerate runs FSDP only on GPUs"})
        print("gpu_fsdp_final_save: not run: no GPU (accelerate runs FSDP only on GPUs)", file=sys.stderr)
        return 1
    env = common.child_env(threads=4)
    for stale in (out, exported):  # this script's own directories from an earlier run
        shutil.rmtree(stale, ignore_errors=True)
    for command in planned:
        common.run_checked(command, env=env, timeout=1800)
    record["result"] = compare(out, exported)
    common.write_results(args.output, record)
    print(json.dumps(record["result"]))
    ok = not record["result"]["differing"] and not record["result"]["extra"]
    print(f"wrote {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
