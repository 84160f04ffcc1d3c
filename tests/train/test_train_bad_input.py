"""train.py's bad-input corpus: every case exits 2 with exactly one line naming the field and the value,
no traceback, and nothing written (--output_dir and any checkpoint it was given are left as they were).

The cases run in this process (`train_helpers.run_in_process`: the ~6 s of imports are paid once); a few
also run as real `python train.py` processes, to prove there is no traceback at the interpreter level.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from train_helpers import REPO, TRAIN_PY, run, run_in_process, tree

from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.train.checkpoint import output_lock, store

ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)


def garbage(size: int) -> bytes:
    """`size` bytes that are no file format: seeded, so a case fails the same way on every run."""
    return random.Random(size).randbytes(size)


@dataclass
class Case:
    argv: list[str]
    """`{d}`: the case's directory, `{out}` its --output_dir, `{model}` / `{ckpt}` what `prepare` built."""
    fragment: str
    """Must appear in the error line."""
    files: dict | None = None
    """Written under `{d}` before the run: {relative path: str | bytes}."""
    prepare: object = None
    """prepare(d, checkpoints) builds what `files` cannot (a damaged model or checkpoint, a held lock)."""


def jsonl(*rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


GOOD_PR = {"prompt": "What is 2 plus 3?", "response": "5"}
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


# --- preparers: damaged models -------------------------------------------------------------------------


def model(mutate):
    def prepare(d: Path, _):
        shutil.copytree(EMBEDDED_MODEL_DIR, d / "model")
        mutate(d / "model")
    return prepare


def rewrite_weights(change):
    def mutate(path: Path):
        weights = load_file(path / "model.safetensors")
        change(weights)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return mutate


def edit_config(**changes):
    def mutate(path: Path):
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))
    return mutate


def write(name: str, content: str | bytes):
    def mutate(path: Path):
        target = path / name
        target.write_bytes(content if isinstance(content, bytes) else content.encode())
    return mutate


def truncate(name: str):
    def mutate(path: Path):
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: len(data) // 2])
    return mutate


def remove(name: str):
    return lambda path: (path / name).unlink()


def sharded_index_with_a_missing_shard(path: Path):
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    weights = load_file(path / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00002.safetensors" for name in weights}}
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


# --- preparers: damaged checkpoints (copies of a real checkpoint-1 of each loop) -------------------------


def ckpt(loop: str, *mutations, reseal: bool = False):
    """A copy of the pristine `loop` checkpoint at {ckpt}, mutated; `reseal` records the damage in a fresh
    manifest (checksums then pass, so the loaders' own checks are what must catch it)."""

    def prepare(d: Path, checkpoints):
        path = d / "ckpt" / "checkpoint-1"
        shutil.copytree(checkpoints[loop], path)
        for mutate in mutations:
            mutate(path)
        if reseal:
            store.seal(path, 1, ONE_PROCESS)

    return prepare


def flip(name: str):
    def mutate(path: Path):
        data = bytearray((path / name).read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only a checksum can tell
        (path / name).write_bytes(bytes(data))
    return mutate


def torch_object(name: str, obj):
    return lambda path: torch.save(obj, path / name)


def edit_manifest(change):
    def mutate(path: Path):
        manifest = json.loads((path / store.MANIFEST).read_text())
        change(manifest)
        (path / store.MANIFEST).write_text(json.dumps(manifest))
    return mutate


def hold_lock(d: Path, _):
    lock = output_lock.OutputDirLock(d / "out")
    lock.acquire()  # another open file description: flock refuses train.py's even in this process
    HELD.append(lock)


HELD: list[output_lock.OutputDirLock] = []
CKPT = "{ckpt}/checkpoint-1"


def dataset_dir(d: Path, _):
    (d / "dataset").mkdir()
    (d / "dataset" / "train.jsonl").write_text(jsonl(GOOD_PR))


def fifo(name: str):
    return lambda d, _: os.mkfifo(d / name)


def template_without_generation_markers(path: Path):
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )


CASES: dict[str, Case] = {
    # --- the command line -------------------------------------------------------------------------------
    "unknown-flag": Case(["--learning_rat", "1e-4"], "--learning_rat"),
    "stray-positional": Case(["extra"], "unrecognized arguments: extra"),
    "flag-without-value": Case(["--learning_rate"], "--learning_rate"),
    "lr-not-a-number": Case(["--learning_rate", "fast"], "--learning_rate"),
    "lr-nan": Case(["--learning_rate", "nan"], "--learning_rate=nan"),
    "lr-inf": Case(["--learning_rate", "inf"], "--learning_rate=inf"),
    "lr-negative": Case(["--learning_rate", "-1"], "--learning_rate=-1.0"),
    "lr-1e30": Case(["--learning_rate", "1e30"], "--learning_rate=1e+30"),
    "lr-above-bound": Case(["--learning_rate", "11"], "--learning_rate=11.0: must be in [0, 10]"),
    "weight-decay-nan": Case(["--weight_decay", "nan"], "--weight_decay=nan"),
    "weight-decay-negative": Case(["--weight_decay", "-0.1"], "--weight_decay=-0.1"),
    "adam-beta1-above-1": Case(["--adam_beta1", "1.5"], "--adam_beta1=1.5"),
    "adam-beta2-equal-1": Case(["--adam_beta2", "1"], "--adam_beta2=1.0"),
    "adam-beta2-negative": Case(["--adam_beta2", "-0.5"], "--adam_beta2=-0.5"),
    "adam-epsilon-inf": Case(["--adam_epsilon", "inf"], "--adam_epsilon=inf"),
    "adam-epsilon-negative": Case(["--adam_epsilon=-1e-8"], "--adam_epsilon=-1e-08"),
    "max-grad-norm-nan": Case(["--max_grad_norm", "nan"], "--max_grad_norm=nan"),
    "max-grad-norm-negative": Case(["--max_grad_norm", "-1"], "--max_grad_norm=-1.0"),
    "epochs-nan": Case(["--num_train_epochs", "nan"], "--num_train_epochs=nan"),
    "epochs-zero-without-max-steps": Case(["--max_steps", "-1", "--num_train_epochs", "0"], "--num_train_epochs=0"),
    "warmup-ratio-2": Case(["--warmup_ratio", "2"], "--warmup_ratio=2"),
    "warmup-ratio-negative": Case(["--warmup_ratio", "-0.1"], "--warmup_ratio=-0.1"),
    "warmup-ratio-nan": Case(["--warmup_ratio", "nan"], "--warmup_ratio=nan"),
    "warmup-ratio-and-steps": Case(["--warmup_ratio", "0.1", "--warmup_steps", "5"], "set only one"),
    "warmup-steps-inf": Case(["--warmup_steps", "inf"], "--warmup_steps=inf"),
    "label-smoothing-nan": Case(["--label_smoothing_factor", "nan"], "--label_smoothing_factor=nan"),
    "save-steps-nan": Case(["--save_steps", "nan"], "--save_steps=nan"),
    "logging-steps-inf": Case(["--logging_steps", "inf"], "--logging_steps=inf"),
    "accumulation-zero": Case(["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps=0"),
    "accumulation-negative": Case(["--gradient_accumulation_steps", "-2"], "--gradient_accumulation_steps=-2"),
    "accumulation-word": Case(["--gradient_accumulation_steps", "two"], "--gradient_accumulation_steps"),
    "accumulation-fraction": Case(["--gradient_accumulation_steps", "1.5"], "--gradient_accumulation_steps"),
    "micro-batch-zero": Case(["--per_device_train_batch_size", "0"], "--per_device_train_batch_size=0"),
    "micro-batch-negative": Case(["--per_device_train_batch_size", "-4"], "--per_device_train_batch_size=-4"),
    "max-steps-word": Case(["--max_steps", "ten"], "--max_steps"),
    "seed-word": Case(["--seed", "lucky"], "--seed"),
    "bf16-and-fp16": Case(["--bf16", "--fp16"], "--bf16 and --fp16"),
    "loop-unknown": Case(["--loop", "keras"], "keras"),
    "dtype-unknown": Case(["--torch_dtype", "float8"], "--torch_dtype"),
    "attention-unknown": Case(["--attn_implementation", "flash"], "--attn_implementation"),
    "completion-only-not-bool": Case(["--completion_only_loss", "maybe"], "--completion_only_loss"),
    "packing-not-bool": Case(["--packing", "maybe"], "--packing"),
    "scheduler-unknown": Case(["--lr_scheduler_type", "foo"], "--lr_scheduler_type"),
    "optimizer-unknown": Case(["--optim", "foo"], "--optim"),
    "save-strategy-unknown": Case(["--save_strategy", "sometimes"], "--save_strategy"),
    "save-strategy-epoch-in-manual-loop": Case(["--loop", "accelerate", "--save_strategy", "epoch"],
                                               "--save_strategy=epoch"),
    # --- flags the manual loop does not apply (hf_scale.train.setup.loop_flags): refused, not ignored ------------
    "manual-loop-group-by-length": Case(["--loop", "accelerate", "--train_sampling_strategy", "group_by_length"],
                                        "--train_sampling_strategy=group_by_length: applied only by --loop trainer; "
                                        "use --loop trainer or drop the flag"),
    "manual-loop-label-smoothing": Case(["--loop", "accelerate", "--label_smoothing_factor", "0.1"],
                                        "--label_smoothing_factor=0.1: applied only by --loop trainer"),
    "manual-loop-empty-cache-steps": Case(["--loop", "accelerate", "--torch_empty_cache_steps", "4"],
                                          "--torch_empty_cache_steps=4: applied only by --loop trainer"),
    "manual-loop-load-best-model": Case(["--loop", "accelerate", "--load_best_model_at_end"],
                                        "--load_best_model_at_end=true: applied only by --loop trainer"),
    "manual-loop-drop-last": Case(["--loop", "accelerate", "--dataloader_drop_last", "true"],
                                  "--dataloader_drop_last=true: applied only by --loop trainer"),
    "manual-loop-plateau-scheduler": Case(["--loop", "accelerate", "--lr_scheduler_type", "reduce_lr_on_plateau"],
                                          "--lr_scheduler_type=reduce_lr_on_plateau: this value is applied only by "
                                          "--loop trainer"),
    "manual-loop-neftune-from-recipe": Case(["{d}/recipe.yaml"], "--neftune_noise_alpha=5.0: applied only by --loop "
                                            "trainer",
                                            files={"recipe.yaml": "loop: accelerate\nneftune_noise_alpha: 5\n"}),
    # --- LoRA: each flag named by itself ----------------------------------------------------------------
    "lora-r-negative": Case(["--lora_r", "-1"], "--lora_r=-1"),
    "lora-alpha-zero": Case(["--lora_r", "4", "--lora_alpha", "0"], "--lora_alpha=0"),
    "lora-alpha-negative": Case(["--lora_r", "4", "--lora_alpha", "-16"], "--lora_alpha=-16"),
    "lora-alpha-fraction": Case(["--lora_r", "4", "--lora_alpha", "0.5"], "--lora_alpha"),
    "lora-dropout-5": Case(["--lora_r", "4", "--lora_dropout", "5"], "--lora_dropout=5.0"),
    "lora-dropout-negative": Case(["--lora_r", "4", "--lora_dropout", "-0.1"], "--lora_dropout=-0.1"),
    "lora-dropout-nan": Case(["--lora_r", "4", "--lora_dropout", "nan"], "--lora_dropout=nan"),
    "lora-targets-empty": Case(["--lora_r", "4", "--lora_target_modules", " , "], "--lora_target_modules"),
    "lora-targets-unknown": Case(["--lora_r", "4", "--lora_target_modules", "q_proj,no_such_proj"],
                                 "--lora_target_modules=q_proj,no_such_proj: no_such_proj is no module of the model; "
                                 "allowed: all-linear or a comma-separated list of down_proj, gate_proj, k_proj,"),
    "load-in-4bit-without-lora": Case(["--load_in_4bit"], "--load_in_4bit with --lora_r=0"),
    # --- data flags -------------------------------------------------------------------------------------
    "bad-row-fraction-above-1": Case(["--max_bad_row_fraction", "2"], "--max_bad_row_fraction=2.0"),
    "bad-row-fraction-negative": Case(["--max_bad_row_fraction", "-0.1"], "--max_bad_row_fraction=-0.1"),
    "bad-row-fraction-nan": Case(["--max_bad_row_fraction", "nan"], "--max_bad_row_fraction=nan"),
    "max-train-samples-zero": Case(["--max_train_samples", "0"], "--max_train_samples 0"),
    "max-train-samples-negative": Case(["--max_train_samples", "-5"], "--max_train_samples -5"),
    "seq-len-zero": Case(["--max_seq_length", "0"], "--max_seq_length 0"),
    "seq-len-negative": Case(["--max_seq_length", "-8"], "--max_seq_length -8"),
    "seq-len-above-model": Case(["--max_seq_length", "100000"], "max_position_embeddings"),
    "no-target-left-after-truncation": Case(["--train_file", "{d}/d.jsonl", "--max_seq_length", "4"],
                                            "--max_seq_length 4", files={"d.jsonl": jsonl(GOOD_PR)}),
    # --- launcher configs -------------------------------------------------------------------------------
    "deepspeed-missing": Case(["--deepspeed", "/nonexistent/ds.json"], "--deepspeed=/nonexistent/ds.json"),
    "deepspeed-not-json": Case(["--deepspeed", "{d}/ds.json"], "not valid JSON", files={"ds.json": "{not json"}),
    "deepspeed-stage-7": Case(["--deepspeed", "{d}/ds.json"], "zero_optimization.stage=7",
                              files={"ds.json": json.dumps({"zero_optimization": {"stage": 7}})}),
    "deepspeed-array": Case(["--deepspeed", "{d}/ds.json"], "must be a JSON object", files={"ds.json": "[1, 2]"}),
    # hf-scale check's zero-section-missing in train.py's words, before accelerate's DeepSpeedPlugin raises it
    "deepspeed-without-zero-section": Case(
        ["--deepspeed", "{d}/ds.json"], "/ds.json: no `zero_optimization` section: accelerate's DeepSpeedPlugin",
        files={"ds.json": json.dumps({"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}})}),
    "deepspeed-directory": Case(["--deepspeed", "{d}"], "is a directory, not a regular file; expected a DeepSpeed"),
    "precision-flag-against-deepspeed-json": Case(["--deepspeed", str(REPO / "ds_configs" / "zero2.json"), "--fp16"],
                                                  "--fp16 conflicts with"),
    "micro-batch-flag-against-deepspeed-json": Case(
        ["--deepspeed", "{d}/ds.json", "--per_device_train_batch_size", "2"],
        "train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size=2",
        files={"ds.json": json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})}),
    "push-to-hub-with-zero3-without-gathering": Case(
        ["--deepspeed", "{d}/ds.json", "--push_to_hub", "--hub_model_id", "me/tiny"],
        "--push_to_hub me/tiny: ZeRO-3 without 16-bit gathering on save",  # before the token (HF_HUB_OFFLINE here)
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 3}})}),
    "hf-scale-config-missing": Case(["--hf_scale_config", "/nonexistent/cfg.yaml"], "/nonexistent/cfg.yaml"),
    "hf-scale-config-world-size": Case(
        ["--hf_scale_config", "{d}/c.yaml"], "world_size=2",
        files={"c.yaml": yaml.safe_dump({"strategy": "ddp", "topology": {"processes_per_machine": 2}})}),
    # `python train.py` with a multi-process config: which generated script starts it (FSDP has no torchrun.sh)
    "hf-scale-config-fsdp-under-python": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate"],
        "c.yaml: world_size=2 (1 machines x 2 processes_per_machine) but the python launcher started WORLD_SIZE=1; "
        "plain python starts one process: start its 2 processes with launch/c.accelerate.sh (written by",
        files={"c.yaml": yaml.safe_dump({"strategy": "fsdp", "topology": {"processes_per_machine": 2}})}),
    "hf-scale-config-zero3-under-python-on-2-machines": Case(
        ["--hf_scale_config", "{d}/z3.yaml"],
        "start its 4 processes with launch/z3.accelerate.sh or launch/z3.torchrun.sh or launch/z3.deepspeed.sh on "
        "each of the 2 machines (written by `hf-scale generate` with hf_scale_configs/z3.yaml)",
        files={"z3.yaml": yaml.safe_dump({"strategy": "deepspeed", "deepspeed": {"zero_stage": 3},
                                          "topology": {"num_machines": 2, "processes_per_machine": 2,
                                                       "main_process_ip": "10.0.0.1"}})}),
    # --- parallelism: refused before the process group, the flags' and the model's reasons before the machine's ---
    "hf-scale-config-context-parallel-on-cpu": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate"],
        "parallelism: cp=2 cannot run on this machine: torch's context_parallel has no sharding strategy for the "
        "CPU SDPA kernel (aten._scaled_dot_product_flash_attention_for_cpu)",
        files={"c.yaml": yaml.safe_dump({"strategy": "fsdp", "topology": {"processes_per_machine": 4},
                                         "parallelism": {"cp": 2}})}),
    # No silent FSDP2 in its place: without a GPU train.py shards with torch's fully_shard only.
    "hf-scale-config-fsdp1-on-cpu": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate"],
        "c.yaml: fsdp.version=1: this machine has no GPU, and train.py runs FSDP1 only through accelerate's FSDP "
        "plugin on GPUs; allowed here: fsdp.version=2",
        files={"c.yaml": yaml.safe_dump({"strategy": "fsdp", "precision": "no", "fsdp": {"version": 1}})}),
    "context-parallel-with-packing": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate", "--packing"],
        "parallelism.cp=2 with --packing: ring attention takes no document mask",
        files={"c.yaml": yaml.safe_dump({"strategy": "fsdp", "topology": {"processes_per_machine": 2},
                                         "parallelism": {"cp": 2}})}),
    "context-parallel-with-eager-attention": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate", "--attn_implementation", "eager"],
        "parallelism.cp=2 with --attn_implementation eager: context parallelism shards only SDPA attention",
        files={"c.yaml": yaml.safe_dump({"strategy": "fsdp", "topology": {"processes_per_machine": 2},
                                         "parallelism": {"cp": 2}})}),
    "context-parallel-with-a-sliding-window-model": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate", "--model_name_or_path", "{d}/model"],
        "parallelism.cp=2: the model has sliding_attention layers; context parallelism computes full causal",
        files={"c.yaml": yaml.safe_dump({"strategy": "fsdp", "topology": {"processes_per_machine": 2},
                                         "parallelism": {"cp": 2}})},
        prepare=model(edit_config(sliding_window=16))),
    "tensor-and-context-parallel-together": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate"],
        "parallelism.tp=2 with parallelism.cp=2: hf_scale's train.py runs TP or CP, not both",
        files={"c.yaml": yaml.safe_dump({"strategy": "fsdp", "topology": {"processes_per_machine": 8},
                                         "parallelism": {"tp": 2, "cp": 2}})}),
    "tensor-parallel-not-dividing-the-heads": Case(  # the embedded model: 4 attention heads, 2 key/value heads
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate"],
        "parallelism.tp=4 does not divide the model's num_key_value_heads=2: each rank must hold whole heads; "
        "allowed tp: 1, 2",
        files={"c.yaml": yaml.safe_dump({"strategy": "ddp", "topology": {"processes_per_machine": 4},
                                         "parallelism": {"tp": 4}})}),
    "sequence-parallel-not-dividing-the-heads": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--loop", "accelerate"],
        "parallelism.sp=4 does not divide the model's num_key_value_heads=2",
        files={"c.yaml": yaml.safe_dump({"strategy": "deepspeed", "topology": {"processes_per_machine": 4},
                                         "parallelism": {"sp": 4}})}),
    "hf-scale-config-conflicting-micro": Case(
        ["--hf_scale_config", "{d}/c.yaml", "--per_device_train_batch_size", "3"],
        "batch.micro_batch_size=4 but --per_device_train_batch_size=3",
        files={"c.yaml": yaml.safe_dump({"strategy": "single", "precision": "no", "batch": {"micro_batch_size": 4}})}),
    # --- the output directory ---------------------------------------------------------------------------
    "output-dir-is-a-file": Case(["--output_dir", "{d}/taken"], "exists and is not a directory", files={"taken": "x"}),
    "output-dir-under-a-file": Case(["--output_dir", "{d}/taken/run"], "cannot be created", files={"taken": "x"}),
    "output-dir-not-writable": Case(["--output_dir", "{d}/ro/run"], "cannot be created (Permission denied)",
                                    prepare=lambda d, _: (d / "ro").mkdir(mode=0o500)),
    "output-dir-existing-not-writable": Case(["--output_dir", "{d}/ro"], "not writable (Permission denied)",
                                             prepare=lambda d, _: (d / "ro").mkdir(mode=0o500)),
    "output-dir-in-use": Case([], "another run is using it (pid", prepare=hold_lock),
    # --- data files -------------------------------------------------------------------------------------
    "train-file-missing": Case(["--train_file", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl: no such file"),
    "train-file-is-a-directory": Case(["--train_file", "{d}"], "is a directory"),
    "train-file-extension": Case(["--train_file", "{d}/d.xml"], "unsupported extension '.xml'",
                                 files={"d.xml": "<a/>"}),
    "train-file-empty": Case(["--train_file", "{d}/d.jsonl"], "the dataset is empty", files={"d.jsonl": ""}),
    "train-file-empty-array": Case(["--train_file", "{d}/d.json"], "the dataset is empty", files={"d.json": "[]"}),
    "csv-header-only": Case(["--train_file", "{d}/d.csv"], "the dataset is empty",
                            files={"d.csv": "prompt,response\n"}),
    "jsonl-syntax": Case(["--train_file", "{d}/d.jsonl"], "could not be read as json: line 1 is not valid JSON "
                         "(Expecting value at column 10)",
                         files={"d.jsonl": '{"text": \n'}),
    "json-not-utf8": Case(["--train_file", "{d}/d.jsonl"], "row 0 of 'text' is not valid UTF-8",
                          files={"d.jsonl": b'{"text": "\xff\xfe\xfa"}\n'}),
    "csv-not-utf8": Case(["--train_file", "{d}/d.csv"], "could not be read as csv",
                         files={"d.csv": b"prompt,response\n\xff\xfe,\xfa\n"}),
    "parquet-garbage": Case(["--train_file", "{d}/d.parquet"], "could not be read as parquet",
                            files={"d.parquet": b"PAR1 this is not parquet"}),
    "train-file-unreadable": Case(["--train_file", "{d}/d.jsonl"], "cannot be read (Permission denied)",
                                  files={"d.jsonl": jsonl({"text": "hello"})},
                                  prepare=lambda d, _: (d / "d.jsonl").chmod(0)),
    "validation-file-missing": Case(["--train_file", "{d}/d.jsonl", "--validation_file", "/nonexistent/v.jsonl"],
                                    "--validation_file /nonexistent/v.jsonl", files={"d.jsonl": jsonl(GOOD_PR)}),
    "validation-file-without-train-file": Case(["--validation_file", "{d}/d.jsonl"], "--validation_file needs",
                                               files={"d.jsonl": jsonl(GOOD_PR)}),
    "dataset-name-and-train-file": Case(["--dataset_name", "{d}", "--train_file", "{d}/d.jsonl"],
                                        "mutually exclusive", files={"d.jsonl": jsonl(GOOD_PR)}),
    "dataset-name-not-loadable": Case(["--dataset_name", "/nonexistent/dataset"], "--dataset_name /nonexistent"),
    "dataset-split-unknown": Case(["--dataset_name", "{d}/dataset", "--train_split", "nope"], "--train_split nope",
                                  prepare=dataset_dir),
    # --- rows that cannot be used: counted, never replaced by empty text --------------------------------
    "text-int": Case(["--train_file", "{d}/d.jsonl"], "'text' is int, not text", files={"d.jsonl": jsonl({"text": 5})}),
    "text-mixed-types": Case(["--train_file", "{d}/d.jsonl"], "index 1, 'text' is int",
                             files={"d.jsonl": jsonl({"text": "a"}, {"text": 5})}),
    "text-null": Case(["--train_file", "{d}/d.jsonl"], "index 0, 'text' is missing",
                      files={"d.jsonl": jsonl({"text": None}, {"text": "fine"})}),
    "text-key-missing": Case(["--train_file", "{d}/d.jsonl"], "index 1, 'text' is missing",
                             files={"d.jsonl": jsonl({"text": "a"}, {"body": "b"})}),
    "text-empty": Case(["--train_file", "{d}/d.jsonl"], "'text' is empty",
                       files={"d.jsonl": jsonl({"text": "a"}, {"text": ""})}),
    "text-blank": Case(["--train_file", "{d}/d.jsonl"], "'text' is empty",
                       files={"d.jsonl": jsonl({"text": "a"}, {"text": " \n\t"})}),
    "text-list": Case(["--train_file", "{d}/d.jsonl"], "'text' is list", files={"d.jsonl": jsonl({"text": ["a"]})}),
    "text-object": Case(["--train_file", "{d}/d.jsonl"], "'text' is dict",
                        files={"d.jsonl": jsonl({"text": {"a": 1}})}),
    "text-bool": Case(["--train_file", "{d}/d.jsonl"], "'text' is bool",
                      files={"d.jsonl": jsonl({"text": "a"}, {"text": True})}),
    "prompt-null": Case(["--train_file", "{d}/d.jsonl"], "'prompt' is missing",
                        files={"d.jsonl": jsonl(GOOD_PR, {"prompt": None, "response": "x"})}),
    "prompt-int": Case(["--train_file", "{d}/d.jsonl"], "'prompt' is int",
                       files={"d.jsonl": jsonl(GOOD_PR, {"prompt": 7, "response": "x"})}),
    "response-null": Case(["--train_file", "{d}/d.jsonl"], "'response' is missing",
                          files={"d.jsonl": jsonl(GOOD_PR, {"prompt": "p", "response": None})}),
    "response-empty": Case(["--train_file", "{d}/d.jsonl"], "'response' is empty",
                           files={"d.jsonl": jsonl(GOOD_PR, {"prompt": "p", "response": ""})}),
    "response-float": Case(["--train_file", "{d}/d.jsonl"], "index 1, 'response' is float",
                           files={"d.jsonl": jsonl({"prompt": "p", "response": "r"},
                                                   {"prompt": "p", "response": 2.5})}),
    "csv-empty-response": Case(["--train_file", "{d}/d.csv"], "'response' is missing",
                               files={"d.csv": "prompt,response\nhello,world\nhi,\n"}),
    "messages-null": Case(["--train_file", "{d}/d.jsonl"], "'messages' is missing",
                          files={"d.jsonl": jsonl(GOOD_CHAT, {"messages": None})}),
    "messages-empty": Case(["--train_file", "{d}/d.jsonl"], "'messages' is empty",
                           files={"d.jsonl": jsonl(GOOD_CHAT, {"messages": []})}),
    "messages-string": Case(["--train_file", "{d}/d.jsonl"], "'messages' is str",
                            files={"d.jsonl": jsonl(GOOD_CHAT, {"messages": "hi"})}),
    "messages-of-strings": Case(["--train_file", "{d}/d.jsonl"], "message 0 of 'messages' is str",
                                files={"d.jsonl": jsonl({"messages": ["hi", "there"]})}),
    "message-without-role": Case(["--train_file", "{d}/d.jsonl"], "message 1 of 'messages' has null role",
                                 files={"d.jsonl": jsonl({"messages": [{"role": "user", "content": "hi"},
                                                                      {"content": "hello"}]})}),
    "message-role-int": Case(["--train_file", "{d}/d.jsonl"], "has int role",
                             files={"d.jsonl": jsonl(GOOD_CHAT, {"messages": [{"role": 1, "content": "x"}]})}),
    "message-content-null": Case(["--train_file", "{d}/d.jsonl"], "has null content",
                                 files={"d.jsonl": jsonl(GOOD_CHAT, {"messages": [{"role": "user",
                                                                                    "content": None}]})}),
    "message-content-list": Case(["--train_file", "{d}/d.jsonl"], "has list content",
                                 files={"d.jsonl": jsonl(GOOD_CHAT, {"messages": [{"role": "user",
                                                                                    "content": ["x"]}]})}),
    "bad-rows-above-the-allowed-fraction": Case(
        ["--train_file", "{d}/d.jsonl", "--max_bad_row_fraction", "0.25"], "--max_bad_row_fraction 0.5",
        files={"d.jsonl": jsonl(GOOD_PR, {"prompt": None, "response": "x"}, GOOD_PR, {"prompt": "p"})}),
    "every-row-bad-even-if-allowed": Case(["--train_file", "{d}/d.jsonl", "--max_bad_row_fraction", "1"],
                                          "2 of 2 rows", files={"d.jsonl": jsonl({"text": 1}, {"text": 2})}),
    # --- columns and formats ----------------------------------------------------------------------------
    "unknown-column": Case(["--text_column", "body"], "--text_column body: no such column"),
    "columns-of-two-formats": Case(["--train_file", "{d}/d.jsonl", "--text_column", "text", "--messages_column",
                                    "messages"], "select different dataset formats",
                                   files={"d.jsonl": jsonl({"text": "a", "messages": []})}),
    "prompt-without-response-column": Case(["--train_file", "{d}/d.jsonl", "--prompt_column", "q"],
                                           "--response_column is needed", files={"d.jsonl": jsonl({"q": "a"})}),
    "undetectable-format": Case(["--train_file", "{d}/d.jsonl"], "cannot tell the dataset format",
                                files={"d.jsonl": jsonl({"a": "x", "b": "y"})}),
    "completion-only-on-plain-text": Case(["--train_file", "{d}/d.txt", "--completion_only_loss", "true"],
                                          "--completion_only_loss true", files={"d.txt": "hello\nworld\n"}),
    "chat-template-without-generation-markers": Case(
        ["--model_name_or_path", "{model}", "--train_file", "{d}/d.jsonl"], "{% generation %}",
        files={"d.jsonl": jsonl(GOOD_CHAT)}, prepare=model(template_without_generation_markers)),
    # --- the model --------------------------------------------------------------------------------------
    "model-path-missing": Case(["--model_name_or_path", "/nonexistent/model"], "--model_name_or_path=/nonexistent"),
    "model-dir-without-config": Case(["--model_name_or_path", "{d}"], "without a valid config.json"),
    "model-config-garbage": Case(["--model_name_or_path", "{model}"], "--model_name_or_path",
                                 prepare=model(write("config.json", "{not json"))),
    "model-weights-truncated": Case(["--model_name_or_path", "{model}"], "the weights cannot be loaded",
                                    prepare=model(truncate("model.safetensors"))),
    "model-weights-garbage": Case(["--model_name_or_path", "{model}"], "the weights cannot be loaded",
                                  prepare=model(write("model.safetensors", garbage(4096)))),
    "model-weights-missing": Case(["--model_name_or_path", "{model}"], "the weights cannot be loaded",
                                  prepare=model(remove("model.safetensors"))),
    "model-weights-other-shapes": Case(["--model_name_or_path", "{model}"], "config.json does not match the weights",
                                       prepare=model(edit_config(intermediate_size=96))),
    "model-weights-lack-tensors": Case(["--model_name_or_path", "{model}"], "lack 1 tensors",
                                       prepare=model(rewrite_weights(lambda w: w.pop("model.norm.weight")))),
    "model-bin-garbage": Case(["--model_name_or_path", "{model}"], "the weights cannot be loaded",
                              prepare=model(lambda p: (remove("model.safetensors")(p),
                                                       write("pytorch_model.bin", garbage(2048))(p)))),
    "model-index-names-a-missing-shard": Case(["--model_name_or_path", "{model}"], "--model_name_or_path",
                                              prepare=model(sharded_index_with_a_missing_shard)),
    "tokenizer-missing": Case(["--tokenizer_name_or_path", "/nonexistent/tok"], "--tokenizer_name_or_path"),
    "tokenizer-garbage": Case(["--model_name_or_path", "{model}"], "--tokenizer_name_or_path",
                              prepare=model(write("tokenizer.json", "{garbage"))),
    # --- --resume_from_checkpoint: refused with the file named, the checkpoint left untouched -----------
    "resume-missing": Case(["--resume_from_checkpoint", "/nonexistent/checkpoint-3"], "no such directory"),
    "resume-a-file": Case(["--resume_from_checkpoint", "{d}/f"], "no such directory", files={"f": "x"}),
    "resume-without-manifest": Case(["--resume_from_checkpoint", CKPT], "no hf_scale_complete.json",
                                    prepare=ckpt("accelerate", remove(store.MANIFEST))),
    "resume-foreign-partial": Case(["--resume_from_checkpoint", "{d}/checkpoint-3"], "no hf_scale_complete.json",
                                   files={"checkpoint-3/optimizer.bin": "partial"}),
    "resume-manifest-garbage": Case(["--resume_from_checkpoint", CKPT], "hf_scale_complete.json is unreadable",
                                    prepare=ckpt("accelerate", write(store.MANIFEST, "{"))),
    "resume-manifest-escapes": Case(["--resume_from_checkpoint", CKPT], "hf_scale_complete.json is unreadable",
                                    prepare=ckpt("accelerate", edit_manifest(
                                        lambda m: m["files"].update({"../../etc/passwd": 1})))),
    "resume-file-missing": Case(["--resume_from_checkpoint", CKPT], "optimizer.bin is missing",
                                prepare=ckpt("accelerate", remove("optimizer.bin"))),
    "resume-file-truncated": Case(["--resume_from_checkpoint", CKPT], "optimizer.bin has",
                                  prepare=ckpt("accelerate", truncate("optimizer.bin"))),
    "resume-weights-flipped": Case(["--resume_from_checkpoint", CKPT], "model.safetensors is corrupt",
                                   prepare=ckpt("accelerate", flip("model.safetensors"))),
    "resume-optimizer-flipped": Case(["--resume_from_checkpoint", CKPT], "optimizer.bin is corrupt",
                                     prepare=ckpt("accelerate", flip("optimizer.bin"))),
    "resume-rng-flipped": Case(["--resume_from_checkpoint", CKPT], "random_states_0.pkl is corrupt",
                               prepare=ckpt("accelerate", flip("random_states_0.pkl"))),
    "resume-scheduler-flipped": Case(["--resume_from_checkpoint", CKPT], "scheduler.bin is corrupt",
                                     prepare=ckpt("accelerate", flip("scheduler.bin"))),
    "resume-state-flipped": Case(["--resume_from_checkpoint", CKPT], "hf_scale_state.json is corrupt",
                                 prepare=ckpt("accelerate", flip(store.STATE))),
    "resume-trainer-state-flipped": Case(["--resume_from_checkpoint", CKPT], "trainer_state.json is corrupt",
                                         prepare=ckpt("trainer", flip("trainer_state.json"))),
    "resume-trainer-rng-flipped": Case(["--resume_from_checkpoint", CKPT], "rng_state.pth is corrupt",
                                       prepare=ckpt("trainer", flip("rng_state.pth"))),
    "resume-trainer-weights-flipped": Case(["--resume_from_checkpoint", CKPT], "model.safetensors is corrupt",
                                           prepare=ckpt("trainer", flip("model.safetensors"))),
    # ... and when the damage was sealed into a valid manifest, the loaders' own checks catch it.
    "resealed-rng-garbage": Case(["--resume_from_checkpoint", CKPT, "--loop", "accelerate"],
                                 "random_states_0.pkl cannot be loaded",
                                 prepare=ckpt("accelerate", write("random_states_0.pkl", b"\x80garbage"), reseal=True)),
    "resealed-rng-without-states": Case(["--resume_from_checkpoint", CKPT, "--loop", "accelerate"],
                                        "random_states_0.pkl does not hold the states",
                                        prepare=ckpt("accelerate", torch_object("random_states_0.pkl", {"step": 1}),
                                                     reseal=True)),
    "resealed-scheduler-garbage": Case(["--resume_from_checkpoint", CKPT, "--loop", "accelerate"],
                                       "scheduler.bin cannot be loaded",
                                       prepare=ckpt("accelerate", write("scheduler.bin", garbage(64)), reseal=True)),
    "resealed-state-garbage": Case(["--resume_from_checkpoint", CKPT, "--loop", "accelerate"],
                                   "hf_scale_state.json is not valid JSON",
                                   prepare=ckpt("accelerate", write(store.STATE, "{,"), reseal=True)),
    "resealed-state-wrong-types": Case(["--resume_from_checkpoint", CKPT, "--loop", "accelerate"],
                                       "lacks a valid step",
                                       prepare=ckpt("accelerate", write(store.STATE, json.dumps(
                                           {"step": "one", "world_size": 1, "strategy": "single", "epoch": 0,
                                            "samples_consumed_in_epoch": 0})), reseal=True)),
    "resealed-trainer-state-garbage": Case(["--resume_from_checkpoint", CKPT], "trainer_state.json is not valid JSON",
                                           prepare=ckpt("trainer", write("trainer_state.json", "nope"), reseal=True)),
    "resealed-trainer-rng-garbage": Case(["--resume_from_checkpoint", CKPT], "rng_state.pth cannot be loaded",
                                         prepare=ckpt("trainer", write("rng_state.pth", b"garbage"), reseal=True)),
    # A load failure needs a step left to train (a run of the checkpoint's 1 step is finished: nothing loads).
    "resealed-optimizer-garbage": Case(["--max_steps", "2", "--resume_from_checkpoint", CKPT, "--loop", "accelerate"],
                                       "loading it failed",
                                       prepare=ckpt("accelerate", write("optimizer.bin", garbage(1024)),
                                                    reseal=True)),
    "resealed-weights-garbage": Case(["--max_steps", "2", "--resume_from_checkpoint", CKPT, "--loop", "accelerate"],
                                     "loading it failed",
                                     prepare=ckpt("accelerate", write("model.safetensors", garbage(1024)),
                                                  reseal=True)),
    "resealed-trainer-optimizer-garbage": Case(["--max_steps", "2", "--resume_from_checkpoint", CKPT],
                                               "loading it failed",
                                               prepare=ckpt("trainer", write("optimizer.pt", garbage(1024)),
                                                            reseal=True)),
    # --- issue 21: what answered with a traceback, was accepted or was noisy -------------------------------
    "model-config-hidden-size-word": Case(["--model_name_or_path", "{model}"],
                                          "hidden_size='big' is invalid: allowed an integer from 1 to",
                                          prepare=model(edit_config(hidden_size="big"))),
    "model-config-heads-zero": Case(["--model_name_or_path", "{model}"],
                                    "num_attention_heads=0 is invalid: allowed an integer from 1 to",
                                    prepare=model(edit_config(num_attention_heads=0))),
    "seed-negative": Case(["--seed", "-1"], "--seed=-1: must be an integer from 0 to 4294967295"),
    "dataloader-workers-negative": Case(["--dataloader_num_workers", "-1"],
                                        "--dataloader_num_workers=-1: must be >= 0"),
    "output-dir-empty": Case(["--output_dir", ""], "--output_dir is empty: it must name a directory"),
    "save-steps-zero-manual-loop": Case(["--loop", "accelerate", "--save_steps", "0"],
                                        "--save_steps=0: must be a whole number of steps >= 1, or a fraction in"),
    "save-steps-negative": Case(["--save_steps", "-3"], "--save_steps=-3: must be a whole number of steps >= 1"),
    "model-config-does-not-match-the-weights": Case(
        ["--model_name_or_path", "{model}"], "config.json does not match the weights: 4 tensors have other shapes "
        "(first: model.layers.0.self_attn.k_proj.weight is [32, 64] in the weights, [48, 64] by config.json)",
        prepare=model(edit_config(num_key_value_heads=3))),
    "train-file-dev-zero": Case(["--train_file", "/dev/zero"], "/dev/zero: is a character device, not a regular file; "
                                "expected a data file (.json"),
    "train-file-fifo": Case(["--train_file", "{d}/p.jsonl"], "is a FIFO (named pipe), not a regular file",
                            prepare=fifo("p.jsonl")),
    "validation-file-directory": Case(["--train_file", "{d}/d.jsonl", "--validation_file", "{d}"],
                                      "is a directory, not a regular file; expected a data file",
                                      files={"d.jsonl": jsonl(GOOD_PR)}),
    "chat-template-dev-zero": Case(["--chat_template_path", "/dev/zero"], "--chat_template_path /dev/zero: is a "
                                   "character device, not a regular file; expected a Jinja chat template file"),
    "chat-template-fifo": Case(["--chat_template_path", "{d}/t.jinja"], "is a FIFO (named pipe), not a regular file",
                               prepare=fifo("t.jinja")),
    "chat-template-directory": Case(["--chat_template_path", "{d}"], "is a directory, not a regular file"),
    "chat-template-not-utf8": Case(["--chat_template_path", "{d}/t.jinja"], "not UTF-8 text (byte 0xff",
                                   files={"t.jinja": b"{{ messages }}\xff"}),
    "deepspeed-dev-zero": Case(["--deepspeed", "/dev/zero"], "--deepspeed=/dev/zero: is a character device"),
    "deepspeed-fifo": Case(["--deepspeed", "{d}/ds.json"], "is a FIFO (named pipe)", prepare=fifo("ds.json")),
    "hf-scale-config-fifo": Case(["--hf_scale_config", "{d}/c.yaml"], "is a FIFO (named pipe)", prepare=fifo("c.yaml")),
    "recipe-dev-zero": Case(["--config", "/dev/zero"], "recipe /dev/zero: is a character device, not a regular file"),
    "recipe-directory": Case(["--config", "{d}"], "is a directory, not a regular file; expected a YAML or JSON"),
    "recipe-fifo": Case(["{d}/r.yaml"], "is a FIFO (named pipe)", prepare=fifo("r.yaml")),
    "model-path-dev-zero": Case(["--model_name_or_path", "/dev/zero"], "--model_name_or_path=/dev/zero: is a character "
                                "device; expected a model directory"),
    "model-path-is-its-config-file": Case(["--model_name_or_path", "{model}/config.json"],
                                          "is a file; expected a model directory", prepare=model(lambda p: None)),
    "adam-epsilon-negative-spaced": Case(["--adam_epsilon", "-1e-8"], "--adam_epsilon=-1e-08: must be >= 0"),
    "learning-rate-negative-exponent": Case(["--learning_rate", "-1e-4"], "--learning_rate=-0.0001: must be in"),
    "weight-decay-negative-exponent": Case(["--weight_decay", "-1E-2"], "--weight_decay=-0.01: must be >= 0"),
    "max-grad-norm-negative-spaced": Case(["--max_grad_norm", "-.5"], "--max_grad_norm=-0.5: must be >= 0"),
    "warmup-steps-negative": Case(["--warmup_steps", "-1"], "--warmup_steps=-1.0: must be >= 0"),
    "learning-rate-minus-inf": Case(["--learning_rate", "-inf"], "--learning_rate=-inf: must be a finite number"),
    # --- invented along the same lines ----------------------------------------------------------------------
    "seed-above-2-to-the-32": Case(["--seed", "4294967296"], "--seed=4294967296: must be an integer from 0 to"),
    "data-seed-negative": Case(["--data_seed", "-5"], "--data_seed=-5: must be an integer from 0 to"),
    "output-dir-blank": Case(["--output_dir", "   "], "--output_dir is only whitespace: it must name a"),
    "logging-steps-zero": Case(["--logging_steps", "0"], "--logging_steps=0: must be a whole number of steps"),
    "logging-steps-negative": Case(["--logging_steps", "-2"], "--logging_steps=-2: must be a whole number"),
    "eval-steps-zero": Case(["--eval_strategy", "steps", "--eval_steps", "0"], "--eval_steps=0: must be a whole"),
    "save-steps-fraction-above-1": Case(["--save_steps", "1.5"], "--save_steps=1.5: must be a whole number of steps"),
    "save-total-limit-zero": Case(["--save_total_limit", "0"], "--save_total_limit=0: must be >= 1"),
    "eval-batch-zero": Case(["--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size=0: must be >= 1"),
    "label-smoothing-above-1": Case(["--label_smoothing_factor", "1.5"], "--label_smoothing_factor=1.5: must be in"),
    "neftune-negative": Case(["--neftune_noise_alpha", "-1"], "--neftune_noise_alpha=-1.0: must be >= 0"),
    "ddp-timeout-zero": Case(["--ddp_timeout", "0"], "--ddp_timeout=0: must be >= 1"),
    "prefetch-factor-zero": Case(["--dataloader_prefetch_factor", "0"], "--dataloader_prefetch_factor=0: must be >= 1"),
    "eval-accumulation-zero": Case(["--eval_accumulation_steps", "0"], "--eval_accumulation_steps=0: must be >= 1"),
    "scheduler-kwargs-not-json": Case(["--lr_scheduler_kwargs", "notjson"], "argument --lr_scheduler_kwargs"),
    "scheduler-kwargs-a-list": Case(["--lr_scheduler_kwargs", "[1]"], "not a JSON object"),
    "scheduler-kwargs-unknown": Case(["--lr_scheduler_kwargs", '{{"foo": 1}}'],
                                     "--lr_scheduler_kwargs: 'foo' is not an argument of --lr_scheduler_type linear; "
                                     "allowed: none"),
    "scheduler-kwargs-for-constant": Case(["--lr_scheduler_type", "constant", "--lr_scheduler_kwargs",
                                           '{{"num_cycles": 0.5}}'], "'num_cycles' is not an argument"),
    "torch-compile-mode-unknown": Case(["--torch_compile_mode", "bogus"], "--torch_compile_mode=bogus: Unrecognized "
                                       "mode=bogus, should be one of: default"),
    "model-config-vocab-negative": Case(["--model_name_or_path", "{model}"], "vocab_size=-1 is invalid",
                                        prepare=model(edit_config(vocab_size=-1))),
    "model-config-layers-zero": Case(["--model_name_or_path", "{model}"], "num_hidden_layers=0 is invalid",
                                     prepare=model(edit_config(num_hidden_layers=0))),
    "model-config-layers-a-million": Case(["--model_name_or_path", "{model}"], "num_hidden_layers=1000000 is invalid",
                                          prepare=model(edit_config(num_hidden_layers=10**6))),
    "model-config-intermediate-float": Case(["--model_name_or_path", "{model}"], "intermediate_size=1.5 is invalid",
                                            prepare=model(edit_config(intermediate_size=1.5))),
    "model-config-hidden-size-list": Case(["--model_name_or_path", "{model}"], "hidden_size=[64] is invalid",
                                          prepare=model(edit_config(hidden_size=[64]))),
    "model-config-head-dim-zero": Case(["--model_name_or_path", "{model}"], "head_dim=0 is invalid",
                                       prepare=model(edit_config(head_dim=0))),
    "model-config-positions-zero": Case(["--model_name_or_path", "{model}"], "max_position_embeddings=0 is invalid",
                                        prepare=model(edit_config(max_position_embeddings=0))),
    "model-config-heads-do-not-divide": Case(["--model_name_or_path", "{model}"], "not a multiple of the number of "
                                             "attention heads", prepare=model(edit_config(num_attention_heads=5))),
    "model-config-eps-word": Case(["--model_name_or_path", "{model}"], "Field 'rms_norm_eps' expected float",
                                  prepare=model(edit_config(rms_norm_eps="tiny"))),
    "model-config-tie-string": Case(["--model_name_or_path", "{model}"], "Field 'tie_word_embeddings' expected bool",
                                    prepare=model(edit_config(tie_word_embeddings="yes"))),
    "model-config-activation-unknown": Case(["--model_name_or_path", "{model}"], "config.json: hidden_act='nope' is "
                                            "not an activation transformers knows; allowed: gelu, gelu_10,",
                                            prepare=model(edit_config(hidden_act="nope"))),
    "model-config-type-unknown": Case(["--model_name_or_path", "{model}"], "config.json: model_type='gpt9' is not an "
                                      "architecture transformers",
                                      prepare=model(edit_config(model_type="gpt9"))),
    "model-config-a-list": Case(["--model_name_or_path", "{model}"], 'config.json has no "model_type"',
                                prepare=model(write("config.json", "[1, 2]"))),
    "model-config-without-type": Case(["--model_name_or_path", "{model}"], 'config.json has no "model_type"',
                                      prepare=model(edit_config(model_type=None))),
    "model-config-nan": Case(["--model_name_or_path", "{model}"], "config.json: rms_norm_eps=NaN is not a finite",
                             prepare=model(write("config.json", (EMBEDDED_MODEL_DIR / "config.json").read_text()
                                                 .replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')))),
    "model-config-duplicate-key": Case(["--model_name_or_path", "{model}"], "duplicate key 'hidden_size'",
                                       prepare=model(write("config.json", (EMBEDDED_MODEL_DIR / "config.json")
                                                           .read_text().replace('"hidden_size": 64',
                                                                                '"hidden_size": 64, "hidden_size": 8'
                                                                                )))),
    "model-config-not-utf8": Case(["--model_name_or_path", "{model}"], "not UTF-8 text",
                                  prepare=model(write("config.json", b'{"model_type": "ll\xffama"}'))),
    "model-config-a-directory": Case(["--model_name_or_path", "{model}"], "config.json: is a directory, not a regular",
                                     prepare=model(lambda p: ((p / "config.json").unlink(),
                                                              (p / "config.json").mkdir()))),
    "model-config-fifo": Case(["--model_name_or_path", "{model}"], "config.json: is a FIFO (named pipe)",
                              prepare=model(lambda p: ((p / "config.json").unlink(),
                                                       os.mkfifo(p / "config.json")))),
    "model-vocab-smaller-than-the-weights": Case(["--model_name_or_path", "{model}"], "2 tensors have other shapes "
                                                 "(first: lm_head.weight is [264, 64] in the weights, [10, 64]",
                                                 prepare=model(edit_config(vocab_size=10))),
    "dataset-scalar-rows": Case(["--train_file", "{d}/d.jsonl"], "could not be read as json: line 2 is a number (5), "
                                "not a JSON object; each row must be a JSON object such as",
                                files={"d.jsonl": '{"text": "a"}\n5\n'}),
    "dataset-array-rows": Case(["--train_file", "{d}/d.jsonl"], "could not be read as json: line 1 is an array ([1, "
                               "2]), not a JSON object",
                               files={"d.jsonl": "[1, 2]\n[3]\n"}),
    "dataset-duplicate-column": Case(["--train_file", "{d}/d.jsonl"], "line 1 has the key 'text' twice; each key once",
                                     files={"d.jsonl": '{"text": "a", "text": "b"}\n'}),
    "dataset-text-only-blank-lines": Case(["--train_file", "{d}/d.txt"], "the train dataset is empty",
                                          files={"d.txt": "\n\n  \n"}),
    "recipe-unknown-key": Case(["{d}/r.yaml"], "unknown key 'learning_rat'; did you mean 'learning_rate'?",
                               files={"r.yaml": "learning_rat: 1\n"}),
    "recipe-value-type": Case(["{d}/r.yaml"], "learning_rate: 'fast' is not a number",
                              files={"r.yaml": "learning_rate: fast\n"}),
    "recipe-negative-seed": Case(["{d}/r.yaml"], "--seed=-3: must be an integer from 0",
                                 files={"r.yaml": "seed: -3\n"}),
    "recipe-save-steps-zero": Case(["{d}/r.yaml"], "--save_steps=0: must be a whole number",
                                   files={"r.yaml": "save_steps: 0\n"}),
    "resume-with-the-other-loop": Case(["--resume_from_checkpoint", CKPT, "--loop", "accelerate"],
                                       "written by --loop trainer", prepare=ckpt("trainer")),
}


@contextlib.contextmanager
def file_permissions_enforced():
    """As root, drop CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH from this thread's effective set for the duration, so
    that a mode-000 file or a read-only directory refuses root too (restored afterwards)."""
    if os.geteuid() != 0:
        yield
        return

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0
    saved = data[0].effective
    data[0].effective &= ~0b110  # CAP_DAC_OVERRIDE (1), CAP_DAC_READ_SEARCH (2)
    assert libc.capset(ctypes.byref(header), data) == 0
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoint-1 of a real one-step run of each loop (made once, on first use)."""
    made = {}

    def get(loop: str) -> Path:
        if loop not in made:
            out = tmp_path_factory.mktemp(f"pristine-{loop}")
            assert run_in_process(["--max_steps", "1", "--save_steps", "1", "--loop", loop,
                                   "--output_dir", str(out)]) == 0
            made[loop] = out / "checkpoint-1"
        return made[loop]

    return _Lazy(get)


class _Lazy:
    def __init__(self, get):
        self.get = get

    def __getitem__(self, loop: str) -> Path:
        return self.get(loop)


@pytest.fixture(autouse=True, scope="module")
def datasets_cache_in_tmp(tmp_path_factory):
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_datasets_cache"))
    yield
    datasets.config.HF_DATASETS_CACHE = saved


def _materialise(case: Case, d: Path, checkpoints) -> list[str]:
    for name, content in (case.files or {}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    if case.prepare is not None:
        case.prepare(d, checkpoints)
    argv = [a.format(d=d, out=d / "out", model=d / "model", ckpt=d / "ckpt") for a in case.argv]
    if "--max_steps" not in argv:
        argv = ["--max_steps", "1", *argv]
    if "--output_dir" not in argv:
        argv += ["--output_dir", str(d / "out")]
    return argv


def _error_line(stderr: str, fragment: str) -> str:
    """The one error line; stderr holds nothing else but hf_scale's own `hf_scale:` lines (no progress bar, no
    library log line, no traceback). splitlines() also splits at a progress bar's carriage returns."""
    assert "Traceback" not in stderr, stderr[-4000:]
    lines = [line for line in stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(lines) == 1, stderr[-4000:]
    others = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("train.py: error:",
                                                                                            "hf_scale: "))]
    assert not others, others[:5]
    assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(name, tmp_path, checkpoints, capfd):
    case = CASES[name]
    argv = _materialise(case, tmp_path, checkpoints)
    out = Path(argv[argv.index("--output_dir") + 1])
    before = {path: tree(path) for path in (out, tmp_path / "ckpt", tmp_path / "model") if path.is_absolute()}
    capfd.readouterr()
    try:
        with file_permissions_enforced():
            code = run_in_process(argv)
        stderr = capfd.readouterr().err
        assert code == 2, stderr[-4000:]
        _error_line(stderr, case.fragment)
        for path, content in before.items():
            assert tree(path) == content, f"{path} changed"
    finally:
        while HELD:
            HELD.pop().release()


# model-config-does-not-match-the-weights: transformers' load report (a table) is not printed before the line;
# dataset-scalar-rows: datasets' "Failed to load JSON ..." log line and progress bars neither (they reach a real
# process's stderr through datasets' own handler); model-weights-truncated: nor the tokenizing bar before it.
SUBPROCESS_CASES = ["lr-nan", "text-int", "resume-weights-flipped", "model-config-does-not-match-the-weights",
                    "dataset-scalar-rows", "model-weights-truncated", "hf-scale-config-fsdp-under-python"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_in_a_real_process_has_no_traceback(name, tmp_path, checkpoints):
    case = CASES[name]
    argv = _materialise(case, tmp_path, checkpoints)
    before = tree(tmp_path / "ckpt")
    result = run([sys.executable, TRAIN_PY, *argv], timeout=300)
    assert result.returncode == 2, result.stderr[-4000:]
    _error_line(result.stderr, case.fragment)
    assert "LOAD REPORT" not in result.stderr and "MISMATCH" not in result.stderr, result.stderr[-4000:]
    assert not (tmp_path / "out").exists()
    assert tree(tmp_path / "ckpt") == before


@pytest.mark.parametrize(("kind", "config"), [
    ("tp", {"strategy": "ddp", "topology": {"processes_per_machine": 2}, "parallelism": {"tp": 2}}),
    ("cp", {"strategy": "fsdp", "topology": {"processes_per_machine": 2}, "parallelism": {"cp": 2}}),
])
def test_a_layout_the_installed_versions_cannot_run_is_one_line_naming_the_version(kind, config, tmp_path, capfd,
                                                                                  monkeypatch):
    """parallelism.version_problem before the process group: the package, the version needed and the one installed
    (a floor above every release stands in for an old install)."""
    from hf_scale.config import parallelism

    monkeypatch.setitem(parallelism.NEEDS, kind, {"torch": "99.0.0"})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    capfd.readouterr()
    code = run_in_process(["--max_steps", "1", "--hf_scale_config", str(tmp_path / "c.yaml"), "--loop", "accelerate",
                           "--output_dir", str(tmp_path / "out")])
    stderr = capfd.readouterr().err
    assert code == 2, stderr[-4000:]
    line = _error_line(stderr, f"parallelism: {kind}=2: {kind} needs torch >= 99.0.0 ({torch.__version__} is "
                               "installed); pip install 'torch>=99.0.0'")
    assert str(tmp_path / "c.yaml") in line
    assert not (tmp_path / "out").exists()
