"""Generated files are accepted by the libraries that consume them: DeepSpeed's config parser (with the
world size the config was made for), accelerate's config loader and launch-argument processing, the HF
Trainer's "auto" resolution, bash, and DeepSpeed's hostfile parser."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from accelerate_launch import launch_environment
from cluster_helpers import launch_scripts

from hf_scale.config.distributed_config import DistributedConfig, load_config, validate_config
from hf_scale.config.presets import PRESETS, get_preset
from hf_scale.contract.deepspeed_json import DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE, deepspeed_config, deepspeed_json
from hf_scale.errors import UserError
from hf_scale.generators import render_files
from hf_scale.generators.accelerate_yaml import accelerate_config, accelerate_yaml
from hf_scale.generators.launch import hostfile

# Exactly the keys transformers' HfTrainerDeepSpeedConfig fills from TrainingArguments / the model.
TRAINER_RESOLVED_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
}
OPTIMIZER_KEYS = {  # only where the JSON has an optimizer block (offload, fused_adam, torch_adam)
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
}
HIDDEN_SIZE_KEYS = {
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def auto_paths(config: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in config.items():
        if isinstance(value, dict):
            paths |= auto_paths(value, f"{prefix}{key}.")
        elif value == "auto":
            paths.add(prefix + key)
    return paths


def resolve_auto_with_samples(
    config: dict, *, world_size: int, micro: int = 2, accum: int = 3, hidden_size: int = 64
) -> dict:
    """What the Trainer would do with sample flags: fill every "auto" consistently with `world_size`."""
    samples = {
        "train_batch_size": micro * accum * world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "optimizer.params.lr": 1e-4,
        "optimizer.params.betas": [0.9, 0.95],
        "optimizer.params.eps": 1e-8,
        "optimizer.params.weight_decay": 0.01,
        "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
    }
    resolved = json.loads(json.dumps(config))
    for path in auto_paths(config):
        *parents, leaf = path.split(".")
        node = resolved
        for parent in parents:
            node = node[parent]
        node[leaf] = samples[path]
    return resolved


class DataParallelWorld:
    """DeepSpeed's documented `mpu` interface (model-parallel unit): the data-parallel world size the
    config is checked against. DeepSpeedConfig only consults it inside an initialised process group."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


@pytest.fixture(scope="module")
def deepspeed_one_process_group():
    """A real 1-process gloo group, so DeepSpeedConfig checks batch arithmetic against a given world size."""
    import deepspeed.comm
    import torch.distributed

    if torch.distributed.is_initialized():
        pytest.skip("a process group already exists in this test process")
    with pytest.MonkeyPatch.context() as env:
        for key, value in {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }.items():
            env.setenv(key, value)
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


def check_with_deepspeed(config: dict, world_size: int):
    from deepspeed.runtime.config import DeepSpeedConfig

    assert not auto_paths(config), "unresolved auto values"
    return DeepSpeedConfig(config, mpu=DataParallelWorld(world_size))


def load_with_accelerate(tmp_path: Path, cfg: DistributedConfig, name: str = "run"):
    from accelerate.commands.config.config_args import load_config_from_file

    ds_file = f"ds_configs/{name}.json" if cfg.strategy == "deepspeed" else None
    path = tmp_path / f"{name}.yaml"
    path.write_text(accelerate_yaml(cfg, deepspeed_config_file=ds_file, header="test"))
    return load_config_from_file(str(path))


# --- the grid: strategy x offload x precision x processes ----------------------------------------------

WORLDS = {1: (1, 1), 2: (1, 2), 8: (1, 8), 16: (2, 8)}
DEEPSPEED_VARIANTS = {
    "zero0": {"zero_stage": 0},
    "zero1": {"zero_stage": 1},
    "zero1_cpu": {"zero_stage": 1, "offload_optimizer": "cpu"},
    "zero2_cpu": {"zero_stage": 2, "offload_optimizer": "cpu", "torch_adam": True},
    "zero3": {"zero_stage": 3},
    "zero3_cpu_params": {"zero_stage": 3, "offload_params": "cpu", "reduce_bucket_size": 1000},
    "zero3_cpu_both": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    "zero3_nvme": {
        "zero_stage": 3,
        "offload_optimizer": "nvme",
        "offload_params": "nvme",
        "nvme_path": "/nvme",
    },
}
FSDP_VARIANTS = {
    "fsdp2_full": {"version": 2},
    "fsdp2_grad_op_offload": {"version": 2, "sharding": "shard_grad_op", "offload_params": True},
    "fsdp2_hybrid": {"version": 2, "sharding": "hybrid_shard"},
    "fsdp1_no_shard_full_sd": {"version": 1, "sharding": "no_shard", "state_dict_type": "full"},
    "fsdp1_hybrid": {"version": 1, "sharding": "hybrid_shard", "transformer_layer_cls_to_wrap": ["A", "B"]},
}


def grid_config(strategy: str, variant: dict, precision: str, processes: int, **extra) -> DistributedConfig:
    machines, per_machine = WORLDS[processes]
    topology = {"num_machines": machines, "processes_per_machine": per_machine}
    if machines > 1:
        topology["main_process_ip"] = "10.0.0.1"
    data = {
        "strategy": strategy,
        "precision": precision,
        "topology": topology,
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 4},
        **extra,
    }
    if strategy == "deepspeed":
        data["deepspeed"] = variant
    if strategy == "fsdp":
        data["fsdp"] = variant
    return validate_config(data)


GRID = [
    pytest.param(strategy, name, variant, id=f"{strategy}-{name}")
    for strategy, variants in [
        ("deepspeed", DEEPSPEED_VARIANTS),
        ("fsdp", FSDP_VARIANTS),
        ("ddp", {"ddp": {}}),
        ("single", {"single": {}}),
    ]
    for name, variant in variants.items()
]


@pytest.mark.parametrize(("strategy", "variant_name", "variant"), GRID)
def test_grid_configs_pass_deepspeed_and_accelerate_parsers(
    strategy, variant_name, variant, tmp_path, deepspeed_one_process_group
):
    from accelerate.utils import DistributedType

    checked = 0
    for processes in WORLDS:
        if strategy == "single" and processes > 1:
            continue
        if "hybrid" in variant_name and WORLDS[processes][0] < 2:
            continue
        for precision in ("no", "fp16", "bf16"):
            cfg = grid_config(
                strategy, variant, precision, processes, activation_checkpointing=processes == 2
            )
            loaded = load_with_accelerate(tmp_path, cfg)
            assert loaded.num_processes == cfg.world_size
            assert loaded.num_machines == cfg.topology.num_machines
            expected_type = {
                "single": DistributedType.NO,
                "ddp": DistributedType.MULTI_GPU,
                "deepspeed": DistributedType.DEEPSPEED,
                "fsdp": DistributedType.FSDP,
            }[strategy]
            assert loaded.distributed_type == expected_type
            if strategy != "deepspeed":
                assert loaded.mixed_precision == precision
                continue
            resolved = check_with_deepspeed(deepspeed_config(cfg, "resolved"), cfg.world_size)
            assert resolved.train_batch_size == 2 * 4 * cfg.world_size
            assert resolved.zero_optimization_stage == variant["zero_stage"]
            assert resolved.bfloat16_config.enabled == (precision == "bf16")
            assert resolved.float16_config.enabled == (precision == "fp16")
            auto = deepspeed_config(cfg, "auto")
            check_with_deepspeed(resolve_auto_with_samples(auto, world_size=cfg.world_size), cfg.world_size)
            checked += 1
    assert checked or strategy != "deepspeed"


def test_deepspeed_rejects_a_batch_made_for_another_world_size(deepspeed_one_process_group):
    """The validation above is not vacuous: the world size really takes part."""
    cfg = grid_config("deepspeed", {"zero_stage": 2}, "bf16", 8)
    with pytest.raises(AssertionError, match="train_batch_size"):
        check_with_deepspeed(deepspeed_config(cfg, "resolved"), world_size=16)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_passes_deepspeed_and_accelerate_parsers(preset, tmp_path, deepspeed_one_process_group):
    cfg = get_preset(preset)
    loaded = load_with_accelerate(tmp_path, cfg, preset)
    assert loaded.num_processes == cfg.world_size
    if cfg.strategy == "deepspeed":
        for mode in ("auto", "resolved"):
            config = deepspeed_config(cfg, mode)
            if mode == "auto":
                config = resolve_auto_with_samples(config, world_size=cfg.world_size)
            check_with_deepspeed(config, cfg.world_size)


# --- DeepSpeed JSON content ----------------------------------------------------------------------------


@pytest.mark.parametrize("fused_adam", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_auto_mode_uses_auto_exactly_for_trainer_resolved_keys(stage, fused_adam):
    cfg = validate_config({"strategy": "deepspeed", "deepspeed": {"zero_stage": stage, "fused_adam": fused_adam}})
    expected = set(TRAINER_RESOLVED_KEYS) | (OPTIMIZER_KEYS if fused_adam else set())
    if stage:
        expected.add("zero_optimization.reduce_bucket_size")
    if stage == 3:
        expected |= HIDDEN_SIZE_KEYS
    assert auto_paths(deepspeed_config(cfg, "auto")) == expected


def test_auto_mode_keeps_configured_bucket_numbers():
    cfg = validate_config(
        {
            "strategy": "deepspeed",
            "deepspeed": {
                "zero_stage": 3,
                "reduce_bucket_size": 123,
                "stage3_prefetch_bucket_size": 456,
                "stage3_param_persistence_threshold": 789,
            },
        }
    )
    config = deepspeed_config(cfg, "auto")
    assert auto_paths(config) == TRAINER_RESOLVED_KEYS
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == 456


@pytest.fixture
def unset_hf_deepspeed_config(monkeypatch):
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # accelerate would set it process-wide otherwise
    yield
    # HfDeepSpeedConfig registers itself globally (ZeRO-3 init of later models) and TrainingArguments
    # creates accelerate's process state singleton: leave no trace for other tests in this process.
    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_hf_trainer_resolves_every_auto_value(precision, tmp_path, unset_hf_deepspeed_config):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    cfg = validate_config(
        {"strategy": "deepspeed", "precision": precision, "deepspeed": {"zero_stage": 3, "fused_adam": True}}
    )
    args = TrainingArguments(
        output_dir=str(tmp_path),
        bf16=precision == "bf16",
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-4,
    )
    ds = HfTrainerDeepSpeedConfig(deepspeed_config(cfg, "auto"))
    ds.trainer_config_process(args)
    ds.trainer_config_finalize(args, model, num_training_steps=10)  # raises on any mismatch
    assert not auto_paths(ds.config)
    assert ds.config["optimizer"]["params"]["lr"] == 3e-4
    assert ds.config["train_batch_size"] == 4 * 2 * args.world_size
    assert ds.config["zero_optimization"]["reduce_bucket_size"] == 32 * 32


def test_concrete_precision_makes_the_trainer_reject_a_mismatching_flag(tmp_path, unset_hf_deepspeed_config):
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    cfg = validate_config({"strategy": "deepspeed", "precision": "bf16", "deepspeed": {"zero_stage": 0}})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])  # no --bf16
    ds = HfTrainerDeepSpeedConfig(deepspeed_config(cfg, "auto"))
    ds.trainer_config_process(args)
    with pytest.raises(ValueError, match="bf16"):
        ds.trainer_config_finalize(args, None, num_training_steps=10)


def test_resolved_mode_writes_the_config_numbers():
    cfg = validate_config(
        {
            "strategy": "deepspeed",
            "gradient_clipping": None,
            "topology": {"processes_per_machine": 4},
            "batch": {"global_batch_size": 64, "micro_batch_size": 2},
            "optimizer": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1},
            "deepspeed": {"zero_stage": 2, "torch_adam": True},
        }
    )
    config = deepspeed_config(cfg, "resolved")
    assert not auto_paths(config)
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (64, 2, 8)
    assert config["gradient_clipping"] == 0.0  # off, not DeepSpeed's implicit default of 1.0
    assert config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1, "torch_adam": True},
    }
    assert config["zero_optimization"]["reduce_bucket_size"] == DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE


@pytest.mark.parametrize("mode", ["auto", "resolved"])
def test_deepspeed_json_has_an_optimizer_block_only_for_offload_and_never_a_scheduler(mode):
    """Without offload the loop's torch AdamW runs: no DeepSpeed op is JIT-built (no nvcc, no compiler)."""
    seen = set()
    for preset in PRESETS:
        cfg = get_preset(preset)
        if cfg.strategy == "deepspeed":
            config = deepspeed_config(cfg, mode)
            assert "scheduler" not in config
            offloaded = "offload_optimizer" in config["zero_optimization"]
            assert ("optimizer" in config) == offloaded, preset
            if offloaded:
                assert config["optimizer"] == {"type": "AdamW", "params": config["optimizer"]["params"]}
                assert "torch_adam" not in config["optimizer"]["params"]  # DeepSpeedCPUAdam
            seen.add(offloaded)
    assert seen == {True, False}


@pytest.mark.parametrize(
    ("settings", "block"),
    [
        ({"zero_stage": 2}, None),
        ({"zero_stage": 2, "fused_adam": True}, {}),
        ({"zero_stage": 3, "torch_adam": True}, {"torch_adam": True}),
        ({"zero_stage": 2, "offload_optimizer": "cpu"}, {}),
        ({"zero_stage": 2, "offload_optimizer": "cpu", "torch_adam": True}, {"torch_adam": True}),
    ],
    ids=["default", "fused_adam", "torch_adam", "offload", "offload-torch_adam"],
)
def test_optimizer_block_follows_fused_adam_torch_adam_and_offload(settings, block):
    config = deepspeed_config(validate_config({"strategy": "deepspeed", "deepspeed": settings}), "auto")
    if block is None:
        assert "optimizer" not in config
    else:
        params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", **block}
        assert config["optimizer"] == {"type": "AdamW", "params": params}


def test_torch_adam_and_fused_adam_together_are_refused():
    with pytest.raises(UserError, match="deepspeed.torch_adam=true and deepspeed.fused_adam=true"):
        load_config(overrides=["strategy=deepspeed", "deepspeed.torch_adam=true", "deepspeed.fused_adam=true"])


def test_offload_blocks_follow_the_config():
    cfg = get_preset("zero3_nvme")
    zero = deepspeed_config(cfg, "auto")["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
    zero2 = deepspeed_config(get_preset("zero2_offload"), "auto")["zero_optimization"]
    assert zero2["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero2 and "stage3_prefetch_bucket_size" not in zero2


def test_activation_checkpointing_block_only_when_enabled():
    cfg = validate_config({"strategy": "deepspeed", "activation_checkpointing": True})
    assert "activation_checkpointing" in deepspeed_config(cfg, "auto")
    assert "activation_checkpointing" not in deepspeed_config(get_preset("zero2"), "auto")


def test_deepspeed_json_text_is_stable_and_newline_terminated():
    cfg = get_preset("zero3_offload")
    text = deepspeed_json(cfg, "auto")
    assert text.endswith("}\n") and text == deepspeed_json(cfg, "auto")
    assert json.loads(text) == deepspeed_config(cfg, "auto")


# --- accelerate YAML content ---------------------------------------------------------------------------


def test_deepspeed_yaml_references_the_json_and_repeats_nothing_accelerate_rejects():
    section = accelerate_config(get_preset("zero3"), deepspeed_config_file="ds_configs/zero3.json")
    assert "mixed_precision" not in section
    assert section["deepspeed_config"] == {
        "deepspeed_config_file": "ds_configs/zero3.json",
        "zero3_init_flag": True,
    }


def test_fsdp2_hybrid_shard_uses_accelerates_parallelism_config():
    config = accelerate_config(get_preset("fsdp2_hybrid_multinode"), deepspeed_config_file=None)
    assert config["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 8,
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": 1,
    }
    assert config["fsdp_config"]["fsdp_version"] == 2
    assert config["num_processes"] == 16 and config["main_process_ip"]


def test_yaml_starts_with_the_header_comment():
    text = accelerate_yaml(get_preset("ddp"), deepspeed_config_file=None, header="line one\n  line two")
    assert text.startswith("# line one\n#   line two\n")
    assert yaml.safe_load(text)["use_cpu"] is False


# --- accelerate's own launch-argument processing -------------------------------------------------------


@pytest.mark.parametrize("preset", list(PRESETS))
def test_accelerate_launch_accepts_every_preset(preset, tmp_path, monkeypatch, unset_hf_deepspeed_config):
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    monkeypatch.chdir(tmp_path)  # accelerate resolves the relative paths from here
    cfg = get_preset(preset)
    for rel_path, text in render_files(cfg, name=preset, deepspeed_mode="auto", header="t").items():
        (tmp_path / rel_path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel_path).write_text(text)
    with launch_environment(f"accelerate_configs/{preset}.yaml", free_port()) as (args, env):
        assert args.num_processes == cfg.world_size
        if cfg.strategy == "deepspeed":
            assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
            assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == f"ds_configs/{preset}.json"
            assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == str(cfg.deepspeed.zero_stage == 3).lower()
            plugin = DeepSpeedPlugin()  # raises on keys duplicated between the YAML and the JSON
            assert plugin.zero_stage == cfg.deepspeed.zero_stage
            assert plugin.offload_optimizer_device == cfg.deepspeed.offload_optimizer
            assert plugin.deepspeed_config["bf16"]["enabled"] is True
        elif cfg.strategy == "fsdp":
            assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.reshard_after_forward is True
            assert plugin.transformer_cls_names_to_wrap is None  # -> the model's _no_split_modules
            if cfg.layout.active:
                from accelerate import ParallelismConfig

                mesh = ParallelismConfig()  # from the PARALLELISM_CONFIG_* variables `accelerate launch` sets
                assert mesh._sizes == cfg.layout.sizes() and mesh.total_size == cfg.world_size
        else:
            assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
        if cfg.topology.num_machines > 1:
            assert args.nnodes == "2" and args.nproc_per_node == "8"


# --- launch scripts ------------------------------------------------------------------------------------


ALL_CONFIGS = [pytest.param(get_preset(name), id=name) for name in PRESETS] + [
    pytest.param(
        validate_config(
            {
                "strategy": "ddp",
                "topology": {
                    "num_machines": 3,
                    "processes_per_machine": 4,
                    "main_process_ip": "h0",
                    "rdzv_backend": "c10d",
                },
            }
        ),
        id="ddp-c10d",
    ),
    pytest.param(
        validate_config(
            {
                "strategy": "deepspeed",
                "topology": {"num_machines": 2, "processes_per_machine": 4, "main_process_ip": "h0"},
            }
        ),
        id="zero2-multinode",
    ),
]


@pytest.mark.parametrize("cfg", ALL_CONFIGS)
def test_launch_scripts_are_valid_bash_and_pass_arguments_through(cfg, tmp_path):
    files = launch_scripts(cfg, "run", header="hf-scale generate --preset x")
    expected = {"run.accelerate.sh", "run.sbatch"} | (
        {"run.torchrun.sh"} if cfg.strategy != "fsdp" else set()
    )
    if cfg.strategy == "deepspeed":
        expected |= {"run.deepspeed.sh"} | ({"run.hostfile"} if cfg.topology.num_machines > 1 else set())
    assert set(files) == expected
    for file_name, text in files.items():
        if file_name.endswith(".hostfile"):
            continue
        lines = text.splitlines()
        assert lines[0] == "#!/usr/bin/env bash"
        first_command = next(line for line in lines[1:] if line and not line.startswith("#"))
        assert first_command == "set -euo pipefail"
        assert '"$@"' in text
        # The header says where it runs from (anywhere) and what reaches the training.
        says = "# Submit from any directory:" if file_name.endswith(".sbatch") else "# Runs from any directory."
        assert says in text
        assert "--hf_scale_config hf_scale_configs/run.yaml" in text
        script = tmp_path / file_name
        script.write_text(text)
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    if "run.torchrun.sh" in files:
        torchrun = files["run.torchrun.sh"]
        assert f"--nnodes {cfg.topology.num_machines}" in torchrun
        assert f"--nproc_per_node {cfg.topology.processes_per_machine}" in torchrun
        assert '--hf_scale_config "$generated_dir"/hf_scale_configs/run.yaml' in torchrun
        assert ('--deepspeed "$generated_dir"/ds_configs/run.json' in torchrun) == (cfg.strategy == "deepspeed")


def test_hostfile_is_parsed_by_deepspeed():
    from deepspeed.launcher.runner import _parse_hostfile

    cfg = validate_config(
        {
            "strategy": "deepspeed",
            "topology": {"num_machines": 3, "processes_per_machine": 4, "main_process_ip": "gpu-a"},
        }
    )
    pool = _parse_hostfile(hostfile(cfg, "run").splitlines())
    assert list(pool.items()) == [("gpu-a", 4), ("node-1", 4), ("node-2", 4)]


PROBE = """\
import os, pathlib, signal, sys, time
out = pathlib.Path(os.environ["PROBE_OUT"])
rank = os.environ.get("RANK", "0")
mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "")
(out / f"env-{rank}").write_text(mixed_precision + " " + " ".join(sys.argv[1:]))
(out / f"cwd-{rank}").write_text(os.getcwd())
(out / f"deepspeed-{rank}").write_text(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", ""))
if "--wait-for-usr1" in sys.argv:
    def stop(signum, frame):
        (out / f"checkpoint-{rank}").write_text("saved")
        from hf_scale.train.checkpoint.preemption import mark_preempted  # what train.py does after saving

        mark_preempted()
        sys.exit(75)
    signal.signal(signal.SIGUSR1, stop)
    (out / f"ready-{rank}").write_text("")
    time.sleep(120)
"""


def generate_into(tmp_path: Path, cfg: DistributedConfig, name: str) -> Path:
    for rel_path, text in render_files(cfg, name=name, deepspeed_mode="auto", header="t").items():
        path = tmp_path / rel_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path / "launch" / f"{name}.accelerate.sh"


def script_env(tmp_path: Path) -> dict:
    from train_helpers import child_env

    bin_dir = str(Path(sys.executable).parent)  # the `accelerate` of this interpreter
    return {
        **child_env(),  # without a rendezvous an in-process test may have left in os.environ
        "TRAIN_SCRIPT": str(tmp_path / "probe.py"),
        "PROBE_OUT": str(tmp_path),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "MAIN_PROCESS_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.parametrize("preset", ["single_gpu", "zero2"])
def test_accelerate_script_runs_the_training_script_with_its_arguments(preset, tmp_path):
    """From another directory: the script finds its files relative to itself (the YAML's relative
    deepspeed_config_file is replaced by the JSON's absolute path) and leaves the cwd alone."""
    raw = get_preset(preset).model_dump()
    raw["topology"]["processes_per_machine"], raw["batch"]["global_batch_size"] = 1, None
    script = generate_into(tmp_path, validate_config(raw), "single")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        ["bash", str(script), "--foo", "a b"],
        cwd=elsewhere,
        env=script_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    config = tmp_path / "hf_scale_configs" / "single.yaml"
    precision = "no" if preset == "zero2" else "bf16"  # DeepSpeed's precision is the JSON's, not accelerate's
    assert (tmp_path / "env-0").read_text() == f"{precision} --hf_scale_config {config} --foo a b"
    assert (tmp_path / "cwd-0").read_text() == str(elsewhere)
    json_file = tmp_path / "ds_configs" / "single.json"
    assert (tmp_path / "deepspeed-0").read_text() == (str(json_file) if preset == "zero2" else "")


def test_usr1_reaches_the_training_processes_and_the_script_exits_75(tmp_path):
    """What SLURM's --signal=USR1 does: signal every process of the step. The launcher must survive, the
    training processes checkpoint and exit 75, and the script reports 75 although torchrun says 1."""
    import psutil

    cfg = validate_config({"strategy": "ddp", "precision": "no", "topology": {"processes_per_machine": 2}})
    script = generate_into(tmp_path, cfg, "ddp2")
    process = subprocess.Popen(
        ["bash", str(script), "--wait-for-usr1"],
        env=script_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "training processes did not start"
            time.sleep(0.2)
        root = psutil.Process(process.pid)
        for proc in [root, *root.children(recursive=True)]:
            proc.send_signal(signal.SIGUSR1)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 75, output[-3000:]
    assert {p.name for p in tmp_path.glob("checkpoint-*")} == {"checkpoint-0", "checkpoint-1"}


def test_generated_files_contain_no_secrets(tmp_path, monkeypatch):
    from hf_scale.commands.cli import main

    secret = "hf_SECRETtoken1234567890"
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(variable, secret)
    for preset in ("zero3_nvme", "fsdp2_hybrid_multinode", "ddp_multinode"):
        assert (
            main(
                [
                    "generate",
                    "--preset",
                    preset,
                    "--output-dir",
                    str(tmp_path),
                    "--set",
                    "deepspeed.zero_stage=3",
                ]
            )
            == 0
        )
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(files) >= 10
    for path in files:
        assert secret not in path.read_text(), path


def test_generate_marks_scripts_executable(tmp_path):
    from hf_scale.commands.cli import main

    assert main(["generate", "--preset", "zero3", "--output-dir", str(tmp_path)]) == 0
    for path in (tmp_path / "launch").iterdir():
        executable = bool(path.stat().st_mode & stat.S_IXUSR)
        assert executable == path.name.endswith((".sh", ".sbatch")), path


SLURM_STANDINS = {
    # Stand-ins for the two SLURM commands the script calls (SLURM itself is not installed here).
    "srun": '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    "scontrol": '#!/usr/bin/env bash\nif [ "$1 $2" = "show job" ]; then echo "   Command=${SBATCH_COMMAND:-}";'
    ' elif [ "$1" = show ]; then for i in $(seq 1 20000); do echo node-$i; done;'
    ' else echo "$*" >> "$SCONTROL_LOG";'
    ' if [ -n "${SCONTROL_DOWN:-}" ]; then echo "scontrol: error: Unable to contact slurm controller" >&2; exit 1; fi;'
    ' fi\n',
}
EXIT_75_PROBE = """\
import os, pathlib, signal, sys, psutil
from hf_scale.train.checkpoint.preemption import mark_preempted
pathlib.Path(os.environ["PROBE_OUT"], "argv").write_text(" ".join(sys.argv[1:]))
pathlib.Path(os.environ["PROBE_OUT"], "resume").write_text(os.environ.get("HF_SCALE_RESUME", ""))
# What SLURM's --signal=USR1 does to the job step (the srun task's processes): the step's shell hears it,
# train.py saves a checkpoint, marks it and exits 75.
signal.signal(signal.SIGUSR1, lambda *_: None)
for proc in psutil.Process().parents():
    if any(part.endswith(".accelerate.sh") for part in proc.cmdline()):
        proc.send_signal(signal.SIGUSR1)
mark_preempted()
sys.exit(75)
"""


def slurm_env(tmp_path: Path, env: dict, submit_dir: Path) -> dict:
    """What a one-node SLURM job step sees, with the stand-in srun/scontrol first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in SLURM_STANDINS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "SLURM_SUBMIT_DIR": str(submit_dir),
            "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "4242",
            "SLURM_NODEID": "0", "SCONTROL_LOG": str(tmp_path / "scontrol.log")}


@pytest.mark.parametrize("given", [[], ["--resume_from_checkpoint", "runs/x/checkpoint-7"],
                                   ["--resume-from-checkpoint", "runs/x/checkpoint-7"]])
def test_sbatch_resumes_automatically_and_requeues_on_exit_75(given, tmp_path, monkeypatch):
    cfg = validate_config({"strategy": "single", "precision": "no"})
    generate_into(tmp_path, cfg, "one")
    (tmp_path / "probe.py").write_text(EXIT_75_PROBE)
    env = slurm_env(tmp_path, script_env(tmp_path), tmp_path)
    result = subprocess.run(["bash", str(tmp_path / "launch" / "one.sbatch"), *given],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 75, result.stderr[-2000:]
    argv = (tmp_path / "argv").read_text()
    assert argv.endswith(" ".join(given))  # passed on as given, nothing added
    assert [word for word in argv.split() if word.startswith("--resume")] == given[:1]
    # train.py resumes `auto` unless its flags (any spelling) name a checkpoint: read as it reads them.
    from hf_scale.contract.parser import parse_flags, resume_default

    monkeypatch.setenv("HF_SCALE_RESUME", (tmp_path / "resume").read_text())
    namespace, flags_given, _ = parse_flags(["--output_dir", "o", *given])
    resume_default(namespace, flags_given)
    assert namespace.resume_from_checkpoint == ("runs/x/checkpoint-7" if given else "auto")
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]


def test_sbatch_still_exits_75_and_says_what_to_do_when_the_requeue_fails(tmp_path):
    """A controller that does not answer `scontrol requeue`: the job still ends with the preemption's 75 (not
    scontrol's 1, which `set -e` would make it) and says that the checkpoint is saved and how to resume."""
    cfg = validate_config({"strategy": "single", "precision": "no"})
    generate_into(tmp_path, cfg, "one")
    (tmp_path / "probe.py").write_text(EXIT_75_PROBE)
    env = {**slurm_env(tmp_path, script_env(tmp_path), tmp_path), "SCONTROL_DOWN": "1"}
    result = subprocess.run(["bash", str(tmp_path / "launch" / "one.sbatch")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 75, result.stderr[-2000:]
    assert "scontrol requeue 4242 failed; the checkpoint is saved: submit the job again" in result.stderr


REFUSAL_PROBE = """\
# train.py's exit on a refusal (hf_scale.errors.exit_refusing): the line into the launch script's marker, exit 2.
from hf_scale.errors import UserError, exit_refusing
exit_refusing("train.py", UserError("--x=1: refused on every rank"))
"""


def test_sbatch_passes_a_refusal_through_as_one_line_and_exit_2_without_requeueing(tmp_path):
    """The sbatch runs NAME.accelerate.sh under srun and exits with its status: a train.py refusal is the line once
    and exit 2 (not accelerate's CalledProcessError traceback and exit 1), and the job is not requeued (only 75
    is)."""
    cfg = validate_config({"strategy": "single", "precision": "no"})
    generate_into(tmp_path, cfg, "one")
    (tmp_path / "probe.py").write_text(REFUSAL_PROBE)
    env = slurm_env(tmp_path, script_env(tmp_path), tmp_path)
    result = subprocess.run(["bash", str(tmp_path / "launch" / "one.sbatch"), "--max_steps", "1"],
                            env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert [line for line in output.splitlines() if line.strip()] == ["train.py: error: --x=1: refused on every rank"]
    assert not (tmp_path / "scontrol.log").exists()


@pytest.mark.multiprocess
def test_sbatch_job_trains_with_every_configured_value_from_its_spool_copy(tmp_path):
    """As SLURM runs it: a copy of the sbatch file in a spool folder, started in the submit directory, which
    holds no generated file. The script finds launch/ through `scontrol show job` (Command=), each node's
    accelerate script passes --hf_scale_config, and the Trainer runs the config's non-default values
    (read back from the live run: hf_scale_live.json). One process (accelerate's plain launcher)."""
    from train_helpers import assert_live_values, child_env

    from hf_scale.commands.cli import main

    root = tmp_path / "generated"
    # precision stays the preset's bf16 (CPU bf16 here): the flags' default is fp32, so bf16 must come from the config.
    values = ["batch.micro_batch_size=1", "batch.gradient_accumulation_steps=3",
              "gradient_clipping=0.7", "optimizer.lr=3e-4", "optimizer.betas=[0.85,0.97]", "optimizer.eps=1e-7",
              "optimizer.weight_decay=0.05", "activation_checkpointing=true"]
    sets = [arg for value in values for arg in ("--set", value)]
    assert main(["generate", "--preset", "single_gpu", *sets, "--name", "one", "--output-dir", str(root)]) == 0
    spool, submit = tmp_path / "spool", tmp_path / "submit"
    spool.mkdir()
    submit.mkdir()
    (spool / "slurm_script").write_text((root / "launch" / "one.sbatch").read_text())
    env = child_env()
    env.pop("TRAIN_SCRIPT", None)
    env = slurm_env(tmp_path, {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}, submit)
    env["SBATCH_COMMAND"] = f"{root / 'launch' / 'one.sbatch'} --max_steps 1"  # Command= path and arguments
    result = subprocess.run(["bash", str(spool / "slurm_script"), "--max_steps", "1", "--output_dir", "out"],
                            cwd=submit, env=env, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    live = assert_live_values(submit / "out", root / "hf_scale_configs" / "one.yaml")
    assert live["loop"] == "trainer" and live["world_size"] == 1 and live["precision"] == "bf16"

