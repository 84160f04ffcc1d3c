"""The CLI's bad-input corpus: every `hf-scale` command against hostile or careless input.

Each case runs `hf_scale.commands.cli.main` in-process in a fresh workspace (the current directory) holding the
case's input files, and must end with exit code 2, exactly one stderr line (`hf-scale...: error: ...`)
that contains the case's fragment (the field or value at fault), no traceback, nothing on stdout, and the
workspace exactly as it was: nothing written, nothing removed. A few cases run as real subprocesses to
prove that no traceback escapes at interpreter level either.

Cases are grouped by class (file kinds, encodings, YAML/JSON strictness, types, ranges, injection,
outputs); each class is covered for every command that reads such an input.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from hf_scale.commands.cli import main
from hf_scale.train.checkpoint import store

ASSETS = Path(__file__).resolve().parents[2] / "hf_scale" / "assets" / "tiny-llama"
TINY_CONFIG = json.loads((ASSETS / "config.json").read_text())

# Special file contents.
FIFO, DIRECTORY, UNREADABLE = object(), object(), object()
CHECKPOINT = object()  # a complete one-process checkpoint of the embedded tiny Llama


@dataclass(frozen=True)
class Case:
    id: str
    argv: list[str]
    fragment: str
    files: dict[str, object] = field(default_factory=dict)


def yaml_text(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False)


def model_config(**changes) -> str:
    return json.dumps({**TINY_CONFIG, **changes})


DDP_YAML = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "mixed_precision": "bf16",
            "machine_rank": 0, "num_machines": 1, "num_processes": 2, "use_cpu": False}
DS_YAML = {**DDP_YAML, "distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "ds.json"}}
DS_JSON = '{"train_batch_size": "auto", "zero_optimization": {"stage": 2}}\n'
METRICS = '{"step": 1, "loss": 2.5, "tokens_per_sec": 100.0}\n{"step": 2, "loss": 2.1, "tokens_per_sec": 110.0}\n'
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)

# --- generate ------------------------------------------------------------------------------------------------


def gen_set(case_id: str, preset: str, sets: list[str], fragment: str) -> Case:
    argv = ["generate", "--preset", preset]
    for item in sets:
        argv += ["--set", item]
    return Case(f"generate-set-{case_id}", argv, fragment)


def gen_file(case_id: str, content: object, fragment: str) -> Case:
    return Case(f"generate-file-{case_id}", ["generate", "run.yaml"], fragment, {"run.yaml": content})


HOSTILE_HOSTS = {
    "command-substitution": "$(touch /tmp/hf_scale_pwned)",
    "backticks": "`touch /tmp/hf_scale_pwned`",
    "brace-then-substitution": "}$(touch /tmp/hf_scale_pwned)",
    "semicolon": "h0; touch /tmp/hf_scale_pwned",
    "single-quote": "h0'x",
    "double-quote": 'h0"x',
    "newline": "h0\nnode-9 slots=8",
    "space": "h0 h1",
    "tab": "h0\th1",
    "pipe": "h0|id",
    "ampersand": "h0&id",
    "redirect": "h0>x",
    "glob": "h*",
    "dollar-brace": "${HOME}",
    "leading-hyphen": "-oProxyCommand=x",
    "trailing-hyphen": "node-",
    "underscore": "gpu_node",
    "empty-label": "a..b",
    "label-too-long": "a" * 64,
    "numeric-tld": "10.0.0.256",
    "ipv6-zone-injection": "fe80::1%$(id)",
    "unicode": "nöde",
    "carriage-return": "h0\rid",
}
HOSTILE_PATHS = {
    "relative": "local_nvme",
    "command-substitution": "/nvme/$(touch /tmp/hf_scale_pwned)",
    "backticks": "/nvme/`id`",
    "semicolon": "/nvme;id",
    "space": "/local nvme",
    "newline": "/nvme\n/other",
    "quote": "/nvme'x",
    "glob": "/nvme/*",
    "tilde": "~/nvme",
    "empty": "''",
}

GENERATE = [
    *[gen_set(f"host-{name}", "ddp_multinode", [f"topology.main_process_ip={json.dumps(value)}"],
              "topology.main_process_ip=") for name, value in HOSTILE_HOSTS.items()],
    *[gen_set(f"nvme-{name}", "zero3_nvme", [f"deepspeed.nvme_path={json.dumps(value) if name != 'empty' else value}"],
              "deepspeed.nvme_path") for name, value in HOSTILE_PATHS.items()],
    gen_set("host-in-yaml-list", "ddp_multinode", ["topology.main_process_ip=[a, b]"], "topology.main_process_ip="),
    gen_set("host-number", "ddp_multinode", ["topology.main_process_ip=10"], "topology.main_process_ip=10"),
    gen_set("host-empty-multinode", "ddp_multinode", ["topology.main_process_ip=''"], "topology.main_process_ip"),
    # Non-finite and boolean numbers.
    gen_set("lr-inf", "zero2", ["optimizer.lr=.inf"], "optimizer.lr=inf"),
    gen_set("lr-1e999", "zero2", ["optimizer.lr=1e999"], "optimizer.lr='1e999'"),
    gen_set("lr-nan", "zero2", ["optimizer.lr=.nan"], "optimizer.lr=nan"),
    gen_set("eps-inf", "zero2", ["optimizer.eps=.inf"], "optimizer.eps=inf"),
    gen_set("weight-decay-nan", "zero2", ["optimizer.weight_decay=.nan"], "optimizer.weight_decay=nan"),
    gen_set("weight-decay-minus-inf", "zero2", ["optimizer.weight_decay=-.inf"], "optimizer.weight_decay=-inf"),
    gen_set("clipping-inf", "zero2", ["gradient_clipping=.inf"], "gradient_clipping=inf"),
    gen_set("beta-nan", "zero2", ["optimizer.betas=[.nan, 0.9]"], "optimizer.betas[0]=nan"),
    gen_set("lr-true", "zero2", ["optimizer.lr=true"], "optimizer.lr=true"),
    gen_set("beta-false", "zero2", ["optimizer.betas=[0.9, false]"], "optimizer.betas[1]=false"),
    gen_set("betas-three", "zero2", ["optimizer.betas=[0.9, 0.99, 0.999]"], "optimizer.betas"),
    gen_set("lr-word", "zero2", ["optimizer.lr=fast"], "optimizer.lr='fast'"),
    gen_set("lr-negative", "zero2", ["optimizer.lr=-1e-5"], "optimizer.lr='-1e-5'"),
    # Strict integers and booleans.
    gen_set("micro-true", "ddp", ["batch.micro_batch_size=true"], "batch.micro_batch_size=true"),
    gen_set("micro-float", "ddp", ["batch.micro_batch_size=2.0"], "batch.micro_batch_size=2.0"),
    gen_set("micro-string", "ddp", ["batch.micro_batch_size='2'"], "batch.micro_batch_size='2'"),
    gen_set("accum-true", "ddp", ["batch.gradient_accumulation_steps=yes"], "batch.gradient_accumulation_steps=true"),
    gen_set("global-float", "ddp", ["batch.global_batch_size=16.5"], "batch.global_batch_size=16.5"),
    gen_set("machines-true", "ddp", ["topology.num_machines=true"], "topology.num_machines=true"),
    gen_set("procs-string", "ddp", ["topology.processes_per_machine='8'"], "topology.processes_per_machine='8'"),
    gen_set("rank-float", "ddp_multinode", ["topology.machine_rank=1.0"], "topology.machine_rank=1.0"),
    gen_set("port-string", "ddp", ["topology.main_process_port='29500'"], "topology.main_process_port='29500'"),
    gen_set("port-true", "ddp", ["topology.main_process_port=true"], "topology.main_process_port=true"),
    gen_set("stage-true", "zero3", ["deepspeed.zero_stage=true"], "deepspeed.zero_stage=true"),
    gen_set("stage-float", "zero3", ["deepspeed.zero_stage=3.0"], "deepspeed.zero_stage=3.0"),
    gen_set("fsdp-version-true", "fsdp2_full_shard", ["fsdp.version=true"], "fsdp.version=true"),
    gen_set("bucket-true", "zero2", ["deepspeed.allgather_bucket_size=true"], "deepspeed.allgather_bucket_size=true"),
    gen_set("bucket-float", "zero3", ["deepspeed.sub_group_size=1e9"], "deepspeed.sub_group_size='1e9'"),
    gen_set("same-network-int", "ddp", ["topology.same_network=1"], "topology.same_network=1"),
    gen_set("pin-memory-string", "zero3_offload", ["deepspeed.pin_memory='yes'"], "deepspeed.pin_memory='yes'"),
    gen_set("torch-adam-null-word", "zero2", ["deepspeed.torch_adam=none"], "deepspeed.torch_adam='none'"),
    gen_set("checkpointing-string", "ddp", ["activation_checkpointing='on'"], "activation_checkpointing='on'"),
    gen_set("bf16-string", "ddp", ["bf16='true'"], "bf16='true'"),
    # Absurd integers.
    gen_set("procs-huge", "ddp", ["topology.processes_per_machine=100000"], "topology.processes_per_machine=100000"),
    gen_set("machines-huge", "ddp_multinode", ["topology.num_machines=1000000"], "topology.num_machines=1000000"),
    gen_set("micro-huge", "ddp", ["batch.micro_batch_size=99999999999"], "batch.micro_batch_size=99999999999"),
    gen_set("accum-huge", "ddp", ["batch.gradient_accumulation_steps=4294967296"],
            "batch.gradient_accumulation_steps=4294967296"),
    gen_set("global-huge", "ddp", ["batch.global_batch_size=1099511627776"], "batch.global_batch_size=1099511627776"),
    gen_set("product-huge", "ddp", ["batch.micro_batch_size=8192", "batch.gradient_accumulation_steps=8192"],
            "samples per optimizer step; allowed at most"),
    gen_set("bucket-huge", "zero2", ["deepspeed.reduce_bucket_size=10000000000000"],
            "deepspeed.reduce_bucket_size=10000000000000"),
    gen_set("live-params-huge", "zero3", ["deepspeed.stage3_max_live_parameters=10000000000000"],
            "deepspeed.stage3_max_live_parameters=10000000000000"),
    gen_set("port-zero", "ddp", ["topology.main_process_port=0"], "topology.main_process_port=0"),
    gen_set("rank-negative", "ddp_multinode", ["topology.machine_rank=-1"], "topology.machine_rank=-1"),
    gen_set("integer-digits", "ddp", ["batch.micro_batch_size=" + "9" * 5000], "--set batch.micro_batch_size="),
    # Data-parallel sizes the strategy gives no meaning (hf_scale.config.parallelism.layout_problems).
    gen_set("ddp-dp-shard-tp", "ddp", ["parallelism.dp_shard=4", "parallelism.tp=2"],
            "parallelism.dp_shard=4 with strategy ddp"),
    gen_set("ddp-dp-shard-dp-replicate", "ddp", ["parallelism.dp_replicate=2", "parallelism.dp_shard=4"],
            "parallelism.dp_shard=4 with strategy ddp"),
    gen_set("zero3-dp-replicate", "zero3", ["parallelism.dp_replicate=2"],
            "parallelism.dp_replicate=2 with strategy deepspeed"),
    # Names of things that reach files.
    gen_set("layer-class-comma", "fsdp2_full_shard", ["fsdp.transformer_layer_cls_to_wrap=['A,B']"],
            "fsdp.transformer_layer_cls_to_wrap[0]='A,B'"),
    gen_set("layer-class-space", "fsdp2_full_shard", ["fsdp.transformer_layer_cls_to_wrap=['Llama Layer']"],
            "fsdp.transformer_layer_cls_to_wrap[0]='Llama Layer'"),
    gen_set("layer-class-digit", "fsdp2_full_shard", ["fsdp.transformer_layer_cls_to_wrap=['1Layer']"],
            "fsdp.transformer_layer_cls_to_wrap[0]='1Layer'"),
    gen_set("layer-class-string", "fsdp2_full_shard", ["fsdp.transformer_layer_cls_to_wrap=LlamaDecoderLayer"],
            "fsdp.transformer_layer_cls_to_wrap='LlamaDecoderLayer'"),
    Case("generate-name-slash", ["generate", "--preset", "ddp", "--name", "a/b"], "--name 'a/b' is invalid"),
    Case("generate-name-dotdot", ["generate", "--preset", "ddp", "--name", ".."], "--name '..' is invalid"),
    Case("generate-name-substitution", ["generate", "--preset", "ddp", "--name", "$(id)"], "--name '$(id)'"),
    Case("generate-name-newline", ["generate", "--preset", "ddp", "--name", "a\nb"], "--name 'a\\nb' is invalid"),
    Case("generate-name-space", ["generate", "--preset", "ddp", "--name", "my run"], "--name 'my run' is invalid"),
    Case("generate-name-too-long", ["generate", "--preset", "ddp", "--name", "n" * 101], "is invalid: use up to 100"),
    Case("generate-name-from-stem", ["generate", "my run.yaml"], "--name 'my run' is invalid",
         {"my run.yaml": "strategy: ddp\n"}),
    # --set syntax.
    gen_set("set-no-equals", "ddp", ["strategy"], "--set 'strategy' is invalid: expected KEY=VALUE"),
    gen_set("set-empty-key", "ddp", ["=ddp"], "--set '=ddp' is invalid"),
    gen_set("set-empty-part", "ddp", ["topology..num_machines=2"], "--set 'topology..num_machines=2'"),
    gen_set("set-duplicate-keys", "ddp", ["topology={a: 1, a: 2}"], "duplicate key 'a'"),
    gen_set("set-alias-bomb", "ddp", ["fsdp=" + ALIAS_BOMB.replace("\n", ", ").join("{}")], "--set fsdp="),
    gen_set("set-recursive-alias", "ddp", ["fsdp=&a [*a]"], "recursive document"),
    gen_set("set-unclosed", "ddp", ["optimizer.betas=[0.9"], "--set optimizer.betas="),
    gen_set("set-into-value", "ddp", ["topology.processes_per_machine.x=1"],
            "--set topology.processes_per_machine.x: topology.processes_per_machine is a value"),
    gen_set("set-unknown-section", "ddp", ["optimiser.lr=1"], "unknown key optimiser"),
    gen_set("set-unknown-field", "zero2", ["deepspeed.stage=3"], "unknown key deepspeed.stage"),
    gen_set("set-literal", "ddp", ["strategy=megatron"], "strategy='megatron'"),
    gen_set("set-offload-device", "zero3", ["deepspeed.offload_params=gpu"], "deepspeed.offload_params='gpu'"),
    # cluster.train_args: what train.py would refuse on every node, and the flags every node passes itself.
    gen_set("train-args-unknown", "zero3", ["cluster.train_args=[--bogus]"],
            "cluster.train_args: unrecognized arguments: --bogus"),
    gen_set("train-args-bad-value", "zero3", ["cluster.train_args=[--max_steps, many]"],
            "cluster.train_args: argument --max_steps/--max-steps: invalid int value: 'many'"),
    gen_set("train-args-contradiction", "zero3", ["cluster.train_args=[--per_device_train_batch_size, '4']"],
            "cluster.train_args: batch.micro_batch_size=1 but --per_device_train_batch_size=4"),
    gen_set("train-args-deepspeed-on-ddp", "ddp", ["cluster.train_args=[--deepspeed, ds.json]"],
            "cluster.train_args: strategy=ddp but --deepspeed=ds.json asks for DeepSpeed; drop --deepspeed"),
    gen_set("train-args-lora-with-tp", "fsdp2_tp", ["cluster.train_args=[--lora_r, '4']"],
            "cluster.train_args: --lora_r=4 with tensor parallelism (parallelism.tp=2)"),
    gen_set("train-args-output-dir", "zero3", ["cluster.train_args=[--output_dir, /elsewhere]"],
            "cluster.train_args: --output_dir is not allowed: every node passes --output_dir /output/zero3"),
    gen_set("train-args-output-dir-dashed", "zero3", ["cluster.train_args=[--output-dir=/elsewhere]"],
            "cluster.train_args: --output_dir is not allowed"),
    gen_set("train-args-hf-scale-config", "zero3", ["cluster.train_args=[--hf_scale_config, x.yaml]"],
            "cluster.train_args: --hf_scale_config is not allowed"),
    gen_set("train-args-sp-trainer-loop", "zero2", ["topology.processes_per_machine=2", "parallelism.sp=2",
                                                   "cluster.train_args=[--loop, trainer]"],
            "cluster.train_args: sp=2 with --loop trainer in a job that restarts itself: the Trainer path does not "
            "resume sequence-parallel runs"),
    # cluster.env: a secret would be written in plain text into every manifest (and is never echoed back); the
    # variables the runtime sets for the rendezvous are its own.
    gen_set("env-hf-token", "zero3", ["cluster.env={HF_TOKEN: hf_AbCdEf0123456789}"],
            "cluster.env is invalid: the variable HF_TOKEN looks like a secret"),
    gen_set("env-api-key", "zero3", ["cluster.env={NCCL_DEBUG: WARN, WANDB_API_KEY: k0123}"],
            "with sky jobs launch --secret WANDB_API_KEY"),
    gen_set("env-github-pat", "zero3", ["cluster.env={GITHUB_PAT: ghp_AbCdEf0123456789}"],
            "the variable GITHUB_PAT looks like a secret"),
    gen_set("env-integer-secret", "zero3", ["cluster.env={DB_PASSWORD: 987654321}"],
            "cluster.env is invalid: the variable DB_PASSWORD looks like a secret"),
    gen_set("env-token-valued", "zero3", ["cluster.env={NOTE: hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567}"],
            "the variable NOTE looks like a secret"),
    gen_set("train-args-hub-token", "zero3", ["cluster.train_args=[--hub_token, hf_AbCdEf0123456789]"],
            "cluster.train_args is invalid: --hub_token passes a secret"),
    gen_set("train-args-token-value", "zero3",
            ["cluster.train_args=[--run_name, hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567]"],
            "argument 1 looks like an access token (not shown here)"),
    gen_set("output-dir-dotdot", "zero3", ["cluster.output_dir=/../../etc"],
            "cluster.output_dir='/../../etc' is invalid: use a path without . or .. parts"),
    gen_set("image-too-long", "zero3", [f"cluster.image=registry.example.com/{'a' * 20_000}:1"],
            "characters long: an image reference is at most 456"),
    gen_set("env-pet", "zero3", ["cluster.env={PET_NNODES: '4'}"], "the variable PET_NNODES is set by the runtime"),
    gen_set("env-skypilot", "zero3", ["cluster.env={SKYPILOT_NODE_RANK: '0'}"],
            "the variable SKYPILOT_NODE_RANK is set by the runtime"),
    gen_set("env-master-addr", "zero3", ["cluster.env={MASTER_ADDR: 10.0.0.1}"],
            "the variable MASTER_ADDR is set by the runtime for the rendezvous"),
    gen_set("env-rank", "zero3", ["cluster.env={RANK: '0'}"], "the variable RANK is set by the runtime"),
    gen_set("env-main-process-port", "zero3", ["cluster.env={MAIN_PROCESS_PORT: '1234'}"],
            "the port from topology.main_process_port"),
    # The config file itself.
    gen_file("missing", None, "run.yaml: not found"),
    gen_file("directory", DIRECTORY, "run.yaml: is a directory"),
    gen_file("fifo", FIFO, "run.yaml: is a FIFO"),
    gen_file("unreadable", UNREADABLE, "config file"),
    gen_file("not-utf8", b"strategy: ddp\n# caf\xe9\n", "not UTF-8 text (byte 0xe9 at line 2)"),
    gen_file("binary", b"\x89PNG\r\n\x1a\n\x00\x00", "run.yaml: not UTF-8"),
    gen_file("too-large", "# padding\n" * 500_000, "larger than"),
    gen_file("syntax", "strategy: [ddp\n", "not valid YAML at line 2"),
    gen_file("tab-indent", "topology:\n\tnum_machines: 2\n", "not valid YAML at line 2"),
    gen_file("two-documents", "strategy: ddp\n---\nstrategy: single\n", "not valid YAML"),
    gen_file("list", "- strategy\n- ddp\n", "the top level must be a mapping"),
    gen_file("scalar", "ddp\n", "the top level must be a mapping"),
    gen_file("duplicate-top-key", "strategy: ddp\nprecision: bf16\nstrategy: deepspeed\n",
             "duplicate key 'strategy' (first at line 1)"),
    gen_file("duplicate-nested-key",
             "strategy: ddp\ntopology:\n  processes_per_machine: 2\n  processes_per_machine: 4\n",
             "duplicate key 'processes_per_machine'"),
    gen_file("alias-bomb", ALIAS_BOMB, "expands to more than"),
    gen_file("too-many-aliases", "a: &a 1\nb: [" + ", ".join(["*a"] * 150) + "]\n", "more than 100 aliases"),
    gen_file("recursive-alias", "fsdp: &a {x: *a}\n", "recursive document"),
    gen_file("deep-nesting", "a: " + "[" * 3000 + "]" * 3000 + "\n", "not valid YAML"),
    gen_file("python-tag", "strategy: !!python/object/apply:os.system ['id']\n", "not valid YAML"),
    gen_file("non-string-key", "{[a, b]: 1}\n", "run.yaml"),
    gen_file("int-key", "1: ddp\n", "key 1 (at the top level) is not a field name"),
    gen_file("nested-int-key", "topology:\n  2: 3\n", "key 2 (under topology) is not a field name"),
    gen_file("host-injection", "strategy: ddp\ntopology:\n  num_machines: 2\n  main_process_ip: $(id)\n",
             "topology.main_process_ip='$(id)'"),
    gen_file("nvme-injection", "strategy: deepspeed\ndeepspeed:\n  zero_stage: 3\n  offload_params: nvme\n"
             "  nvme_path: /x;id\n", "deepspeed.nvme_path='/x;id'"),
    gen_file("bool-flag-string", "strategy: ddp\nfp16: 'false'\n", "fp16='false'"),
    # Outputs.
    Case("generate-output-is-file", ["generate", "--preset", "ddp", "--output-dir", "out"], "--output-dir out is not",
         {"out": "a file\n"}),
    Case("generate-output-parent-is-file", ["generate", "--preset", "ddp", "--output-dir", "f/out"],
         "--output-dir f/out: f is not a directory", {"f": "a file\n"}),
    Case("generate-target-is-directory", ["generate", "--preset", "ddp"], "launch/ddp.sbatch: it is a directory",
         {"launch/ddp.sbatch/x": "x\n"}),
    Case("generate-target-is-fifo", ["generate", "--preset", "ddp"], "launch/ddp.sbatch: is a FIFO",
         {"launch/ddp.sbatch": FIFO}),
    Case("generate-subdir-is-file", ["generate", "--preset", "ddp"], "launch exists and is not a directory",
         {"launch": "a file\n"}),
    Case("generate-edited-file", ["generate", "--preset", "ddp"], "accelerate_configs/ddp.yaml exists with different",
         {"accelerate_configs/ddp.yaml": "# mine\n"}),
    Case("generate-no-input", ["generate"], "give a CONFIG.yaml or --preset"),
    Case("generate-bad-mode", ["generate", "--preset", "zero2", "--deepspeed-mode", "magic"],
         "argument --deepspeed-mode: invalid choice: 'magic'"),
    # Planning flags without --strategy auto: those with no config field are refused, the others apply as --set.
    Case("generate-plan-seq-len-without-auto", ["generate", "--preset", "zero3", "--seq-len", "8192"],
         "--seq-len 8192: the config has no field for it, only the planner uses it: add --strategy auto"),
    Case("generate-plan-gpu-memory-without-auto", ["generate", "--preset", "zero3", "--gpu-memory", "40GiB"],
         "--gpu-memory 40GiB: the config has no field for it"),
    Case("generate-plan-4bit-without-auto", ["generate", "--preset", "ddp", "--load-in-4bit"],
         "--load-in-4bit: the config has no field for it"),
    Case("generate-plan-checkpointing-auto-without-auto",
         ["generate", "--preset", "ddp", "--activation-checkpointing", "auto"],
         "--activation-checkpointing auto: the config has no field for it"),
    Case("generate-plan-micro-zero-without-auto", ["generate", "--preset", "ddp", "--micro-batch-size", "0"],
         "--micro-batch-size 0 is invalid: allowed an integer from 1 to"),
    Case("generate-plan-machines-without-address", ["generate", "--preset", "zero3", "--num-machines", "2"],
         "topology.main_process_ip is required when topology.num_machines=2"),
    Case("generate-auto-no-model", ["generate", "--strategy", "auto"], "--strategy auto needs --model"),
    Case("generate-auto-bad-gpus", ["generate", "--strategy", "auto", "--model", "m.json", "--gpus-per-machine", "0"],
         "--gpus-per-machine 0 is invalid", {"m.json": model_config()}),
]

# --- check -------------------------------------------------------------------------------------------------


def check_case(case_id: str, files: dict[str, object], fragment: str, extra: list[str] | None = None) -> Case:
    return Case(f"check-{case_id}", ["check", "--accelerate-config", "acc.yaml", *(extra or [])], fragment, files)


CHECK = [
    check_case("yaml-missing", {}, "--accelerate-config acc.yaml: not found"),
    check_case("yaml-directory", {"acc.yaml": DIRECTORY}, "acc.yaml: is a directory"),
    check_case("yaml-fifo", {"acc.yaml": FIFO}, "acc.yaml: is a FIFO"),
    check_case("yaml-unreadable", {"acc.yaml": UNREADABLE}, "--accelerate-config"),
    check_case("yaml-not-utf8", {"acc.yaml": b"distributed_type: MULTI_GPU\nx: \xff\n"}, "not UTF-8 text (byte 0xff"),
    check_case("yaml-utf16", {"acc.yaml": yaml_text(DDP_YAML).encode("utf-16")}, "acc.yaml: not UTF-8"),
    check_case("yaml-syntax", {"acc.yaml": "distributed_type: [MULTI_GPU\n"}, "acc.yaml: not valid YAML"),
    check_case("yaml-list", {"acc.yaml": "- a\n"}, "expected a mapping"),
    check_case("yaml-empty", {"acc.yaml": ""}, "expected a mapping"),
    check_case("yaml-duplicate", {"acc.yaml": yaml_text(DDP_YAML) + "num_processes: 8\n"},
               "duplicate key 'num_processes'"),
    check_case("yaml-alias-bomb", {"acc.yaml": ALIAS_BOMB}, "expands to more than"),
    check_case("yaml-too-large", {"acc.yaml": "#" * (5 * 2**20)}, "larger than"),
    check_case("json-missing", {"acc.yaml": yaml_text(DS_YAML)}, "ds.json"),
    check_case("json-directory", {"acc.yaml": yaml_text(DS_YAML), "ds.json": DIRECTORY}, "ds.json: is a directory"),
    check_case("json-fifo", {"acc.yaml": yaml_text(DS_YAML), "ds.json": FIFO}, "ds.json: is a FIFO"),
    check_case("json-not-utf8", {"acc.yaml": yaml_text(DS_YAML), "ds.json": b'{"a": "\xc3\x28"}'},
               "ds.json: not UTF-8"),
    check_case("json-syntax", {"acc.yaml": yaml_text(DS_YAML), "ds.json": '{"train_batch_size": 8,}'},
               "ds.json: not valid JSON at line 1"),
    check_case("json-nan", {"acc.yaml": yaml_text(DS_YAML), "ds.json": '{"gradient_clipping": NaN}'},
               "gradient_clipping=NaN is not a finite number"),
    check_case("json-infinity",
               {"acc.yaml": yaml_text(DS_YAML), "ds.json": '{"optimizer": {"params": {"lr": Infinity}}}'},
               "optimizer.params.lr=Infinity"),
    check_case("json-1e999", {"acc.yaml": yaml_text(DS_YAML), "ds.json": '{"train_batch_size": 1e999}'},
               "train_batch_size=1e999"),
    check_case("json-duplicate", {"acc.yaml": yaml_text(DS_YAML), "ds.json": '{"a": 1, "a": 2}'}, "duplicate key 'a'"),
    check_case("json-list", {"acc.yaml": yaml_text(DS_YAML), "ds.json": "[1, 2]"}, "expected a mapping"),
    check_case("json-deep", {"acc.yaml": yaml_text(DS_YAML), "ds.json": "[" * 100_000}, "not valid JSON"),
    check_case("json-flag-fifo", {"acc.yaml": yaml_text(DDP_YAML), "d.json": FIFO}, "d.json: is a FIFO",
               ["--deepspeed-config", "d.json"]),
    check_case("json-flag-missing", {"acc.yaml": yaml_text(DDP_YAML)}, "nope.json: not found",
               ["--deepspeed-config", "nope.json"]),
    check_case("training-arg-json-fifo", {"acc.yaml": yaml_text(DDP_YAML), "t.json": FIFO}, "t.json: is a FIFO",
               ["--", "--deepspeed", "t.json"]),
    check_case("runner", {"acc.yaml": yaml_text(DDP_YAML)}, "--runner 'torchrun'", ["--runner", "torchrun"]),
    check_case("training-arg-type", {"acc.yaml": yaml_text(DDP_YAML)}, "invalid int value: 'four'",
               ["--", "--per_device_train_batch_size", "four"]),
    check_case("training-arg-float", {"acc.yaml": yaml_text(DDP_YAML)}, "invalid float value: 'fast'",
               ["--", "--learning_rate", "fast"]),
    Case("check-no-file", ["check"], "check: no file to check: give an accelerate config (YAML with distributed_type"),
    # `hf-scale check FILE...`: each file recognized by its content.
    Case("check-file-missing", ["check", "my.yaml"], "check: my.yaml: not found; expected an accelerate config, a "
         "DeepSpeed config, an hf_scale config or a cluster manifest"),
    Case("check-file-directory", ["check", "d"], "check: d: is a directory", {"d/x": "x"}),
    Case("check-file-fifo", ["check", "p.yaml"], "check: p.yaml: is a FIFO", {"p.yaml": FIFO}),
    Case("check-file-of-no-kind", ["check", "notes.yaml"], "check: notes.yaml is not a file check reads: give an "
         "accelerate config (YAML with distributed_type or compute_environment), a DeepSpeed config",
         {"notes.yaml": "model: gpt2\nsteps: 10\n"}),
    # A train.py recipe is no config: said so, with how check reads it (bf16 and gradient_accumulation_steps are
    # DeepSpeed keys too: it was "DeepSpeed config ...: not valid JSON").
    Case("check-file-recipe", ["check", "recipe.yaml"], "check: recipe.yaml is a train.py recipe (every key is a "
         "train.py flag", {"recipe.yaml": "model_name_or_path: gpt2\nlearning_rate: 1e-5\n"}),
    Case("check-file-generated-recipe", ["check", "r.yaml"], "not a config: check it as train.py reads it, among the "
         "training args after the configs: hf-scale check CONFIG... -- r.yaml",
         {"r.yaml": "# Written by hf-scale generate --recipe\nbf16: true\ngradient_accumulation_steps: 4\n"
                    "per_device_train_batch_size: 2\nmax_seq_length: null\n"}),
    Case("check-file-list", ["check", "l.json"], "check: l.json is not a file check reads", {"l.json": "[1, 2]"}),
    Case("check-file-json-syntax", ["check", "ds.json"], "ds.json: not valid JSON at line 1",
         {"ds.json": '{"train_batch_size": 8,}'}),
    Case("check-two-yamls", ["check", "a.yaml", "b.yaml"], "check: 2 accelerate configs given (a.yaml, b.yaml)",
         {"a.yaml": yaml_text(DDP_YAML), "b.yaml": yaml_text(DDP_YAML)}),
    Case("check-file-and-flag", ["check", "a.yaml", "--accelerate-config", "b.yaml"],
         "check: 2 accelerate configs given (--accelerate-config b.yaml, a.yaml)",
         {"a.yaml": yaml_text(DDP_YAML), "b.yaml": yaml_text(DDP_YAML)}),
    Case("check-hf-scale-config-twice", ["check", "c.yaml", "--", "--hf_scale_config", "c.yaml"],
         "check: c.yaml and --hf_scale_config in the training args", {"c.yaml": "strategy: ddp\n"}),
    Case("check-hf-scale-config-invalid", ["check", "c.yaml"],
         "check: hf_scale config c.yaml: topology.processes_per_machine=0 is invalid",
         {"c.yaml": "strategy: ddp\ntopology: {processes_per_machine: 0}\n"}),
    Case("passthrough-to-a-command-without-it", ["presets", "--", "x"], "unrecognized arguments: -- x"),
]

# --- plan --------------------------------------------------------------------------------------------------


def plan_case(case_id: str, flags: list[str], fragment: str, files: dict[str, object] | None = None,
              model: str = "m.json") -> Case:
    files = {"m.json": model_config(), **(files or {})}
    return Case(f"plan-{case_id}", ["plan", model, *flags], fragment, files)


PLAN = [
    plan_case("model-missing", [], "MODEL './none.json': no such file", model="./none.json"),
    plan_case("model-fifo", [], "m.json: is a FIFO", {"m.json": FIFO}),
    plan_case("model-dir-without-config", [], "directory has no config.json", {"d/x": "x"}, model="d"),
    plan_case("model-dir-config-is-dir", [], "d/config.json: is a directory, not a regular file",
              {"d/config.json/x": "x"}, model="d"),
    plan_case("model-not-utf8", [], "m.json: not UTF-8", {"m.json": b'{"model_type": "ll\xffama"}'}),
    plan_case("model-syntax", [], "not valid JSON at line 1", {"m.json": '{"model_type": "llama",}'}),
    plan_case("model-nan", [], "hidden_size=NaN is not a finite number", {"m.json": '{"hidden_size": NaN}'}),
    plan_case("model-duplicate", [], "duplicate key 'hidden_size'",
              {"m.json": '{"model_type": "llama", "hidden_size": 64, "hidden_size": 128}'}),
    plan_case("model-list", [], 'has no "model_type"', {"m.json": "[1]"}),
    plan_case("model-no-type", [], 'has no "model_type"', {"m.json": '{"hidden_size": 64}'}),
    plan_case("model-type-unknown", [], "model_type 'gpt9' is unknown", {"m.json": model_config(model_type="gpt9")}),
    plan_case("vocab-string", [], "vocab_size='abc' is invalid", {"m.json": model_config(vocab_size="abc")}),
    plan_case("layers-million", [], "num_hidden_layers=1000000 is invalid",
              {"m.json": model_config(num_hidden_layers=1_000_000)}),
    plan_case("layers-true", [], "num_hidden_layers=True is invalid", {"m.json": model_config(num_hidden_layers=True)}),
    plan_case("layers-zero", [], "num_hidden_layers=0 is invalid", {"m.json": model_config(num_hidden_layers=0)}),
    plan_case("hidden-negative", [], "hidden_size=-64 is invalid", {"m.json": model_config(hidden_size=-64)}),
    plan_case("hidden-float", [], "hidden_size=64.5 is invalid", {"m.json": model_config(hidden_size=64.5)}),
    plan_case("heads-huge", [], "num_attention_heads=100000 is invalid",
              {"m.json": model_config(num_attention_heads=100_000)}),
    plan_case("experts-times-layers", [], "num_hidden_layers x experts",
              {"m.json": json.dumps({"model_type": "mixtral", "num_hidden_layers": 512, "num_local_experts": 1024,
                                     "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "vocab_size": 256})}),
    plan_case("gpus-zero", ["--gpus-per-machine", "0"], "--gpus-per-machine 0 is invalid"),
    plan_case("gpus-huge", ["--gpus-per-machine", "100000"], "--gpus-per-machine 100000 is invalid"),
    plan_case("gpus-word", ["--gpus-per-machine", "eight"], "argument --gpus-per-machine: invalid int value"),
    plan_case("machines-zero", ["--num-machines", "0"], "--num-machines 0 is invalid"),
    plan_case("machines-old-spelling", ["--machines", "0"], "--num-machines 0 is invalid"),
    plan_case("machines-huge", ["--num-machines", "99999999"], "--num-machines 99999999 is invalid"),
    plan_case("seq-zero", ["--seq-len", "0"], "--seq-len 0 is invalid"),
    plan_case("seq-huge", ["--seq-len", "1000000000"], "--seq-len 1000000000 is invalid"),
    plan_case("micro-zero", ["--micro-batch-size", "0"], "--micro-batch-size 0 is invalid"),
    plan_case("micro-old-spelling", ["--micro-batch", "0"], "--micro-batch-size 0 is invalid"),
    plan_case("micro-huge", ["--micro-batch-size", "999999999"], "--micro-batch-size 999999999 is invalid"),
    plan_case("lora-negative", ["--lora-r", "-1"], "--lora-r -1 is invalid"),
    plan_case("lora-huge", ["--lora-r", "10000000"], "--lora-r 10000000 is invalid"),
    plan_case("gpu-memory-unit", ["--gpu-memory", "80XB"], "--gpu-memory '80XB' is invalid"),
    plan_case("gpu-memory-zero", ["--gpu-memory", "0GB"], "--gpu-memory '0GB' is invalid"),
    plan_case("gpu-memory-negative", ["--gpu-memory=-80GB"], "--gpu-memory '-80GB' is invalid"),
    # a size starting with a dash is the flag's value (inputs.NEGATIVE_NUMBER), not argparse's "expected one argument"
    plan_case("gpu-memory-dash-value", ["--gpu-memory", "-80GB"], "--gpu-memory '-80GB' is invalid"),
    plan_case("cpu-memory-dash-value-spaced", ["--cpu-memory", "-1.5 TiB"], "--cpu-memory '-1.5 TiB' is invalid"),
    plan_case("gpu-memory-word", ["--gpu-memory", "lots"], "--gpu-memory 'lots' is invalid"),
    plan_case("cpu-memory-word", ["--cpu-memory", "1TX"], "--cpu-memory '1TX' is invalid"),
    plan_case("margin-one", ["--safety-margin", "1"], "--safety-margin 1.0 is invalid"),
    plan_case("margin-negative", ["--safety-margin", "-0.1"], "--safety-margin -0.1 is invalid"),
    plan_case("margin-nan", ["--safety-margin", "nan"], "--safety-margin nan is invalid"),
    plan_case("margin-inf", ["--safety-margin", "inf"], "--safety-margin inf is invalid"),
    plan_case("precision", ["--precision", "fp8"],
              "argument --precision: invalid choice: 'fp8' (choose from 'no', 'bf16', 'fp16', 'bfloat16'"),
    plan_case("optimizer", ["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    plan_case("plot-directory", ["--plot", "d"], "--plot d: is a directory", {"d/x": "x"}),
    plan_case("plot-parent-file", ["--plot", "f/p.png"], "--plot f/p.png: f is not a directory", {"f": "x"}),
    plan_case("write-config-directory", ["--write-config", "d"], "--write-config d: is a directory", {"d/x": "x"}),
    plan_case("write-config-fifo", ["--write-config", "p.yaml"], "--write-config p.yaml: exists and is not a regular",
              {"p.yaml": FIFO}),
    plan_case("write-config-exists", ["--seq-len", "512", "--write-config", "p.yaml"],
              "--write-config p.yaml exists with different content; pass --force to replace it",
              {"p.yaml": "strategy: ddp  # edited\n"}),
    plan_case("hardware-missing", ["--hardware", "h.yaml"], "--hardware h.yaml: not found"),
    plan_case("hardware-fifo", ["--hardware", "h.yaml"], "--hardware h.yaml: is a FIFO", {"h.yaml": FIFO}),
    plan_case("hardware-list", ["--hardware", "h.yaml"], "--hardware h.yaml: expected a mapping of the fields",
              {"h.yaml": "[1, 2]\n"}),
    plan_case("hardware-syntax", ["--hardware", "h.yaml"], "--hardware h.yaml", {"h.yaml": "a: [\n"}),
    plan_case("hardware-unknown-field", ["--hardware", "h.yaml"], "unknown field 'nvlink': allowed architecture",
              {"h.yaml": "nvlink: 900\n"}),
    plan_case("hardware-missing-field", ["--hardware", "h.yaml"], "missing field 'bf16_tflops'",
              {"h.yaml": "architecture: hopper\nlabel: x\nmemory_gib: 80\n"}),
    plan_case("hardware-with-gpu", ["--gpu", "a10g", "--hardware", "h.yaml"], "--gpu a10g and --hardware h.yaml "
              "are both given: choose one", {"h.yaml": "{}\n"}),
    plan_case("calibrate-missing", ["--calibrate", "run"], "--calibrate run: not a directory"),
    plan_case("calibrate-without-metrics", ["--calibrate", "run"], "--calibrate run: no metrics.jsonl",
              {"run/x": "x"}),
    plan_case("calibrate-metrics-fifo", ["--calibrate", "run"], "--calibrate run: metrics.jsonl cannot be read (file "
              "run/metrics.jsonl: is a FIFO", {"run/metrics.jsonl": FIFO}),
    plan_case("calibrate-empty-metrics", ["--calibrate", "run"], "--calibrate run: metrics.jsonl has no training step",
              {"run/metrics.jsonl": ""}),
    plan_case("calibrate-without-checkpoint", ["--calibrate", "run"], "no checkpoint-STEP/hf_scale_state.json",
              {"run/metrics.jsonl": json.dumps({"step": 1, "loss": 2.0, "tokens": 512, "step_time_s": 0.5}) + "\n"}),
]

# --- plot --------------------------------------------------------------------------------------------------


def plot_case(case_id: str, content: object, fragment: str, args: list[str] | None = None,
              name: str = "metrics.jsonl") -> Case:
    return Case(f"plot-{case_id}", ["plot", name, *(args if args is not None else ["-o", "plot.png"])], fragment,
                {name: content} if content is not None else {})


def record(**changes) -> str:
    return json.dumps({"step": 1, "loss": 2.0, **changes}) + "\n"


PLOT = [
    plot_case("missing", None, "metrics.jsonl: not found"),
    plot_case("directory", DIRECTORY, "metrics.jsonl: is a directory"),
    plot_case("fifo", FIFO, "metrics.jsonl: is a FIFO"),
    plot_case("unreadable", UNREADABLE, "metrics"),
    plot_case("not-utf8", b'{"step": 1, "loss": 2.0}\n\xfe\n', "not UTF-8 text (byte 0xfe at line 2)"),
    plot_case("not-json", METRICS + "garbage\n", "metrics.jsonl:3: not a JSON object"),
    plot_case("json-list-line", "[1, 2]\n", "metrics.jsonl:1: a metrics record needs 'step' and 'loss'"),
    plot_case("no-loss", '{"step": 1}\n', "a metrics record needs 'step' and 'loss'"),
    plot_case("loss-string", record(loss="abc"), "metrics.jsonl:1: loss='abc' is not a number"),
    plot_case("loss-bool", record(loss=True), "loss=True is not a number"),
    plot_case("loss-null", record(loss=None), "loss=None is not a number"),
    plot_case("loss-list", record(loss=[1]), "loss=[1] is not a number"),
    plot_case("step-string", record(step="1"), "step='1' is not a step number"),
    plot_case("step-float", record(step=1.5), "step=1.5 is not a step number"),
    plot_case("step-negative", record(step=-3), "step=-3 is not a step number"),
    plot_case("rate-string", record(tokens_per_sec="fast"), "tokens_per_sec='fast' is not a number"),
    plot_case("rate-negative", record(tokens_per_sec=-1), "tokens_per_sec=-1 is not a number"),
    plot_case("empty", "\n\n", "no metrics records"),
    plot_case("results-not-json", "{", "results file results.json: not valid JSON", name="results.json"),
    plot_case("results-nan", '{"results": {"ddp": {"tokens_per_s": NaN}}}', "tokens_per_s=NaN",
              name="results.json"),
    plot_case("results-no-rates", '{"results": {"ddp": {}}}', "expected a benchmark results file",
              name="results.json"),
    plot_case("results-rate-string", '{"results": {"ddp": {"tokens_per_s": "1"}}}', "expected a benchmark results",
              name="results.json"),
    plot_case("results-negative", '{"results": {"ddp": {"tokens_per_s": -5}}}', "expected a benchmark results",
              name="results.json"),
    plot_case("results-with-labels", '{"results": {"ddp": {"tokens_per_s": 5}}}', "--labels applies to metrics",
              ["-o", "p.png", "--labels", "x"], name="results.json"),
    plot_case("labels-count", METRICS, "--labels: 2 label(s) for 1 metrics file(s)",
              ["-o", "p.png", "--labels", "a", "b"]),
    plot_case("output-directory", METRICS, "-o out.png: is a directory", ["-o", "out.png"]),
    plot_case("output-type", METRICS, "unsupported image type 'xyz'", ["-o", "plot.xyz"]),
    plot_case("output-no-suffix", METRICS, "unsupported image type ''", ["-o", "plot"]),
    plot_case("output-parent-file", METRICS, "-o metrics.jsonl/p.png: metrics.jsonl is not a directory",
              ["-o", "metrics.jsonl/p.png"]),
    plot_case("output-fifo", METRICS, "-o p.png: exists and is not a regular file", ["-o", "p.png"]),
    plot_case("no-output", METRICS, "the following arguments are required: -o/--output", []),
]
# Extra files some plot cases need besides their input.
PLOT_EXTRA = {"plot-output-directory": {"out.png/x": "x"}, "plot-output-fifo": {"p.png": FIFO}}
PLOT = [Case(c.id, c.argv, c.fragment, {**c.files, **PLOT_EXTRA.get(c.id, {})}) for c in PLOT]

# --- export ------------------------------------------------------------------------------------------------


def export_case(case_id: str, files: dict[str, object], fragment: str, flags: list[str] | None = None,
                source: str = "ck") -> Case:
    return Case(f"export-{case_id}", ["export", source, "out", *(flags or [])], fragment, files)


EXPORT = [
    export_case("missing", {}, "CHECKPOINT_DIR ck: no such directory"),
    export_case("file", {"ck": "x"}, "CHECKPOINT_DIR ck: is not a directory"),
    export_case("fifo", {"ck": FIFO}, "CHECKPOINT_DIR ck: is not a directory"),
    export_case("no-manifest", {"ck/config.json": model_config()}, "CHECKPOINT_DIR ck: incomplete or corrupt"),
    export_case("manifest-garbage", {"ck/hf_scale_complete.json": b"\xff\xfe"}, "incomplete or corrupt"),
    export_case("manifest-directory", {"ck/hf_scale_complete.json/x": "x"}, "incomplete or corrupt"),
    export_case("garbage-safetensors-header", {"ck": CHECKPOINT, "ck/model.safetensors": "GARBAGE"},
                "CHECKPOINT_DIR ck: cannot be read (SafetensorError"),
    export_case("empty-safetensors", {"ck": CHECKPOINT, "ck/model.safetensors": ""},
                "CHECKPOINT_DIR ck: cannot be read"),
    export_case("config-not-json", {"ck": CHECKPOINT, "ck/config.json": "{"}, "ck/config.json: not valid JSON at"),
    export_case("config-not-utf8", {"ck": CHECKPOINT, "ck/config.json": b"\xff"}, "ck/config.json: not UTF-8 text"),
    export_case("latest-dangling", {"ck": CHECKPOINT, "ck/latest": "global_step9"},
                "CHECKPOINT_DIR ck: 'latest' names global_step9, which is not a directory in it"),
    export_case("no-weights", {"ck/config.json": model_config(), "ck": CHECKPOINT, "ck/model.safetensors": None},
                "no model weights found"),
    export_case("out-not-empty", {"ck": CHECKPOINT, "out/x": "x"}, "OUT_DIR out: already exists and is not empty"),
    export_case("out-is-file", {"ck": CHECKPOINT, "out": "x"}, "OUT_DIR out: exists and is not a directory"),
    Case("export-out-dev-null", ["export", "ck", "/dev/null"], "OUT_DIR /dev/null: exists and is not a directory",
         {"ck": CHECKPOINT}),
    export_case("lora-on-full", {"ck": CHECKPOINT}, "--lora merged: ck is not a LoRA checkpoint", ["--lora", "merged"]),
    export_case("merge-on-full", {"ck": CHECKPOINT}, "error: --merge: ck is not a LoRA checkpoint", ["--merge"]),
    export_case("shard-size-word", {"ck": CHECKPOINT}, "--max-shard-size 'big'", ["--max-shard-size", "big"]),
    export_case("shard-size-zero", {"ck": CHECKPOINT}, "--max-shard-size '0'", ["--max-shard-size", "0"]),
    export_case("shard-size-negative", {"ck": CHECKPOINT}, "--max-shard-size '-5GB'", ["--max-shard-size=-5GB"]),
    export_case("dtype", {"ck": CHECKPOINT}, "argument --dtype: invalid choice: 'fp8'", ["--dtype", "fp8"]),
    export_case("lora-mode", {"ck": CHECKPOINT}, "argument --lora: invalid choice: 'both'", ["--lora", "both"]),
    Case("export-no-out", ["export", "ck"], "the following arguments are required: OUT_DIR"),
]

# --- the other commands -----------------------------------------------------------------------------------

OTHER = [
    Case("presets-argument", ["presets", "zero3"], "unrecognized arguments: zero3"),
    Case("presets-flag", ["presets", "--all"], "unrecognized arguments: --all"),
    Case("schema-argument", ["schema", "out.json"], "unrecognized arguments: out.json"),
    Case("schema-flag", ["schema", "--format", "yaml"], "unrecognized arguments: --format yaml"),
    Case("demo-steps-zero", ["demo", "--max-steps", "0"], "--max-steps=0: must be >= 1"),
    Case("demo-steps-negative", ["demo", "--max-steps", "-5"], "--max-steps=-5: must be >= 1"),
    Case("demo-steps-word", ["demo", "--max-steps", "many"], "argument --max-steps: invalid int value: 'many'"),
    Case("demo-loop", ["demo", "--loop", "deepspeed"], "argument --loop: invalid choice: 'deepspeed'"),
    Case("demo-output-is-file", ["demo", "--output-dir", "f", "--max-steps", "1"], "is not a directory", {"f": "x"}),
    Case("unknown-command", ["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
    Case("no-command", [], "the following arguments are required: COMMAND"),
    Case("unknown-global-flag", ["--quiet", "presets"], "unrecognized arguments: --quiet"),
]

# --- issue 21: devices, FIFOs and directories named as what they are; negative numbers read as values; a model
# config.json refused by the one rule train.py shares (hf_scale.knowledge.model_shapes.check_dimensions) -----------

DOCTOR_EXPECTS = "expected a DistributedConfig YAML, an accelerate YAML or a DeepSpeed JSON"

ISSUE_21 = [
    Case("doctor-config-dev-zero", ["doctor", "--config", "/dev/zero"],
         f"--config /dev/zero: is a character device, not a regular file; {DOCTOR_EXPECTS}"),
    Case("doctor-config-fifo", ["doctor", "--config", "p.yaml"], "--config p.yaml: is a FIFO (named pipe), not a "
         "regular file", {"p.yaml": FIFO}),
    Case("doctor-config-directory", ["doctor", "--config", "d"], f"--config d: is a directory, not a regular file; "
         f"{DOCTOR_EXPECTS}", {"d/x": "x"}),
    Case("doctor-config-missing", ["doctor", "--config", "nope.yaml"],
         f"--config nope.yaml: not found; {DOCTOR_EXPECTS}"),
    Case("doctor-config-not-utf8", ["doctor", "--config", "c.yaml"], "--config c.yaml: not UTF-8 text (byte 0xff at "
         "line 1)", {"c.yaml": b"x: \xff\n"}),
    Case("doctor-config-unreadable", ["doctor", "--config", "c.yaml"], "--config c.yaml", {"c.yaml": UNREADABLE}),
    Case("doctor-slurm-missing", ["doctor", "--slurm", "nope.sbatch"],
         "--slurm nope.sbatch: not found; expected a generated launch/NAME.sbatch file"),
    Case("doctor-partition-without-slurm", ["doctor", "--partition", "gpu"],
         "--partition gpu: only with --slurm FILE.sbatch"),
    Case("plan-model-dev-zero", ["plan", "/dev/zero"], "/dev/zero: is a character device, not a regular file"),
    Case("plan-model-config-fifo", ["plan", "d"], "d/config.json: is a FIFO (named pipe)", {"d/config.json": FIFO}),
    plan_case("hidden-word", [], "MODEL 'm.json': hidden_size='big' is invalid: allowed an integer from 1 to",
              {"m.json": model_config(hidden_size="big")}),
    plan_case("heads-zero", [], "MODEL 'm.json': num_attention_heads=0 is invalid: allowed an integer from 1 to",
              {"m.json": model_config(num_attention_heads=0)}),
    plan_case("positions-zero", [], "max_position_embeddings=0 is invalid: allowed an integer from 1 to",
              {"m.json": model_config(max_position_embeddings=0)}),
    plan_case("positions-word", [], "max_position_embeddings='x' is invalid",
              {"m.json": model_config(max_position_embeddings="x")}),
    plan_case("kv-heads-negative", [], "num_key_value_heads=-2 is invalid",
              {"m.json": model_config(num_key_value_heads=-2)}),
    plan_case("head-dim-zero", [], "head_dim=0 is invalid", {"m.json": model_config(head_dim=0)}),
    plan_case("margin-negative-exponent", ["--safety-margin", "-1e-2"], "--safety-margin -0.01 is invalid: allowed 0"),
    plan_case("margin-minus-inf", ["--safety-margin", "-inf"], "--safety-margin -inf is invalid"),
    plan_case("seq-negative", ["--seq-len", "-5"], "--seq-len -5 is invalid: allowed an integer from 1"),
    plan_case("gpus-negative", ["--gpus-per-machine", "-1"], "--gpus-per-machine -1 is invalid"),
    plan_case("machines-negative", ["--num-machines", "-2"], "--num-machines -2 is invalid"),
    plan_case("micro-negative", ["--micro-batch-size", "-1"], "--micro-batch-size -1 is invalid"),
    plan_case("seq-exponent-not-int", ["--seq-len", "-1e3"], "argument --seq-len: invalid int value: '-1e3'"),
    check_case("training-arg-negative-epsilon", {"acc.yaml": yaml_text(DDP_YAML)}, "training args: "
               "--adam_epsilon=-1e-08: must be >= 0 (train.py refuses them the same way)",
               ["--", "--adam_epsilon", "-1e-8"]),
    check_case("training-arg-save-steps-zero", {"acc.yaml": yaml_text(DDP_YAML)}, "--save_steps=0: must be a whole",
               ["--", "--save_steps", "0"]),
    check_case("training-arg-seed-negative", {"acc.yaml": yaml_text(DDP_YAML)}, "--seed=-1: must be an integer",
               ["--", "--seed", "-1"]),
    Case("check-yaml-dev-zero", ["check", "--accelerate-config", "/dev/zero"], "/dev/zero: is a character device"),
    Case("check-json-dev-zero", ["check", "--accelerate-config", "acc.yaml", "--deepspeed-config", "/dev/zero"],
         "/dev/zero: is a character device", {"acc.yaml": yaml_text(DDP_YAML)}),
    Case("generate-file-dev-zero", ["generate", "/dev/zero"], "/dev/zero: is a character device, not a regular file"),
    Case("plot-dev-zero", ["plot", "/dev/zero", "-o", "p.png"], "/dev/zero: is a character device, not a regular file"),
    Case("plot-results-fifo", ["plot", "results.json", "-o", "p.png"], "results.json: is a FIFO (named pipe)",
         {"results.json": FIFO}),
    Case("export-dev-zero", ["export", "/dev/zero", "out"], "CHECKPOINT_DIR /dev/zero: is not a directory"),
    export_case("config-fifo", {"ck": CHECKPOINT, "ck/config.json": FIFO}, "config.json: is a FIFO (named pipe)"),
    export_case("config-hidden-word", {"ck": CHECKPOINT, "ck/config.json": model_config(hidden_size="big")},
                "hidden_size='big' is invalid: allowed an integer from 1 to"),
    export_case("config-heads-zero", {"ck": CHECKPOINT, "ck/config.json": model_config(num_attention_heads=0)},
                "num_attention_heads=0 is invalid: allowed an integer from 1 to"),
    export_case("shard-size-negative-spaced", {"ck": CHECKPOINT}, "--max-shard-size '-5e3'", ["--max-shard-size",
                                                                                            "-5e3"]),
    Case("demo-steps-negative-exponent", ["demo", "--max-steps", "-1e3"], "argument --max-steps: invalid int value: "
         "'-1e3'"),
    Case("demo-steps-minus-one-spaced", ["demo", "--max-steps", "-1"], "--max-steps=-1: must be >= 1"),
]

CASES = [*GENERATE, *CHECK, *PLAN, *PLOT, *EXPORT, *OTHER, *ISSUE_21]
# Cases that print to stdout before the error line (the demo echoes its first command).
STDOUT_ALLOWED = {"demo-output-is-file"}


# --- the harness ---------------------------------------------------------------------------------------------


def _make_checkpoint(path: Path) -> None:
    shutil.copytree(ASSETS, path, dirs_exist_ok=True)


def materialize(root: Path, files: dict[str, object]) -> None:
    """Create the case's inputs under root; a complete checkpoint is made last, after its overrides."""
    checkpoints = [name for name, content in files.items() if content is CHECKPOINT]
    for name in checkpoints:
        _make_checkpoint(root / name)
    for name, content in files.items():
        path = root / name
        if content is CHECKPOINT:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.unlink(missing_ok=True)
        elif content is FIFO:
            path.unlink(missing_ok=True)  # in place of a checkpoint's file too
            os.mkfifo(path)
        elif content is DIRECTORY:
            path.mkdir()
        elif content is UNREADABLE:
            path.symlink_to("/proc/self/mem")  # open() works, read() fails with EIO (root reads anything else)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    for name in checkpoints:
        (root / name / store.MANIFEST).unlink(missing_ok=True)
        store.write_manifest(root / name, 1)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root with its kind and content hash (FIFOs are never opened)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            if path.is_symlink():
                state[rel] = "link:" + os.readlink(path)
            elif path.is_dir():
                state[rel] = "dir"
            elif path.is_fifo():
                state[rel] = "fifo"
            else:
                state[rel] = f"{st.st_mode:o}:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return state


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    root = tmp_path / "ws"
    root.mkdir()
    monkeypatch.chdir(root)
    return root


@pytest.mark.parametrize("override", [
    "cluster.env={HF_TOKEN: hf_AbCdEf0123456789}",
    "cluster.env={DB_PASSWORD: 987654321}",  # a number: refused as a secret, not as "not a valid string"
    "cluster.env={DB_PASSWORD: [987654321]}",
    "cluster.env.DB_PASSWORD=987654321",
    "cluster.train_args=[--hub_token, hf_AbCdEf0123456789]",
    "cluster.train_args=['--hub-token=987654321']",
])
def test_a_refused_secret_is_never_echoed(override, workspace, capfd):
    with pytest.raises(SystemExit):
        main(["generate", "--preset", "zero3", "--targets", "kubeflow,skypilot", "--set", override])
    secret = "hf_AbCdEf0123456789" if "hf_" in override else "987654321"
    err = "".join(capfd.readouterr())
    assert secret not in err and ("looks like a secret" in err or "passes a secret" in err), err
    assert not any(workspace.iterdir())


def test_the_corpus_is_large_and_ids_are_unique():
    assert len(CASES) >= 170
    assert len({case.id for case in CASES}) == len(CASES)
    commands = {case.argv[0] for case in CASES if case.argv}
    assert commands >= {"generate", "check", "plan", "plot", "export", "presets", "schema", "demo"}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, workspace, capfd):
    """capfd, not capsys: a library's log handler writes to the stderr it found at import, past sys.stderr."""
    materialize(workspace, case.files)
    before = snapshot(workspace)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(list(case.argv))
    out, err = capfd.readouterr()
    assert exited.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hf-scale") and ": error: " in lines[0], lines[0]
    assert case.fragment in lines[0], lines[0]
    assert "Traceback" not in err
    assert out == "" or case.id in STDOUT_ALLOWED, out
    assert snapshot(workspace) == before


# A few through the interpreter: nothing escapes as a traceback at exit either.
SUBPROCESS_CASES = ["generate-set-host-command-substitution", "check-json-nan", "plot-loss-string",
                    "export-garbage-safetensors-header"]


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_bad_input_in_a_real_process_has_no_traceback(case_id, workspace):
    case = next(c for c in CASES if c.id == case_id)
    materialize(workspace, case.files)
    before = snapshot(workspace)
    result = subprocess.run([sys.executable, "-m", "hf_scale", *case.argv], capture_output=True, text=True,
                            timeout=300, cwd=workspace)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and case.fragment in result.stderr, result.stderr
    assert snapshot(workspace) == before


# --- the classes, fuzzed: any kind of value anywhere is a verdict (a result or one line), never a traceback ---

ANY_KIND = ["x", [1], -1, None, True, {"a": 1}, 1.5, 10**12]


def _verdict(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return code, err


@pytest.fixture
def quiet_transformers():
    """transformers' log handler keeps the stderr of the test that first logged (a closed capture by now):
    its warnings about odd configs are not under test here."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(level)


@pytest.mark.parametrize("key", sorted(TINY_CONFIG))
def test_any_value_in_a_model_config_is_planned_or_one_line(key, workspace, capsys, quiet_transformers):
    for value in ANY_KIND[:5]:
        (workspace / "m.json").write_text(model_config(**{key: value}))
        code, err = _verdict(["plan", "m.json"], capsys)
        # A plan may come with transformers' own warnings about the config; a refusal is one line.
        assert code in (0, 2) and "Traceback" not in err, (key, value, err)
        assert code == 0 or err.count("\n") == 1, (key, value, err)


def _fields(model, prefix: str = "") -> list[str]:
    from pydantic import BaseModel

    paths = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _fields(annotation, f"{prefix}{name}.")
        else:
            paths.append(prefix + name)
    return paths


def test_any_value_in_any_config_field_is_generated_or_one_line(workspace, capsys):
    from hf_scale.config.distributed_config import DistributedConfig

    fields = _fields(DistributedConfig)
    assert len(fields) > 40
    for path in fields:
        for value in ANY_KIND:
            (workspace / "run.yaml").write_text(yaml_text(_nested(path, value)))
            code, err = _verdict(["generate", "run.yaml", "--output-dir", "out"], capsys)
            assert code in (0, 2) and err.count("\n") <= 1 and "Traceback" not in err, (path, value, err)
            assert code == 0 or not (workspace / "out").exists()
            shutil.rmtree(workspace / "out", ignore_errors=True)


def _nested(path: str, value) -> dict:
    data: dict = {"strategy": "deepspeed", "topology": {"processes_per_machine": 2}}
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data
