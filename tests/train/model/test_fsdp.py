"""The FSDP plugin train.py builds from a --hf_scale_config's fsdp section (hf_scale.train.model.fsdp) is accelerate's
own FullyShardedDataParallelPlugin with the version and the sharding the config asks for, and the plugin `accelerate
launch` builds from the generated accelerate YAML: both paths run the same FSDP.

In-process, on CPU: the plugins are built, not used (sharding with them needs GPUs; FSDP2 on CPU is torch's
fully_shard, tests/train/loops/test_loops_equivalence.py). FSDP1's `sync_module_states` makes accelerate build a
param_init_fn on the current accelerator device, which raises on a machine without one after every other field is
parsed: there (only) the plugins are built with it, and with cpu_ram_efficient_loading that forces it, off; both
are asserted as values instead.
"""

from __future__ import annotations

import functools

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin, patch_environment
from accelerate_launch import launch_environment
from torch.distributed.fsdp import ShardingStrategy
from train_helpers import free_port
from transformers import AutoConfig, AutoModelForCausalLM

from hf_scale.config.distributed_config import validate_config
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.generators.accelerate_yaml import accelerate_yaml
from hf_scale.train.model import fsdp

VARIANTS = [(2, "full_shard"), (2, "shard_grad_op"), (2, "hybrid_shard"),
            (1, "full_shard"), (1, "shard_grad_op"), (1, "hybrid_shard"), (1, "no_shard")]
DEVICE_BOUND = {"sync_module_states": False, "cpu_ram_efficient_loading": False}
"""FSDP1's fields accelerate resolves on an accelerator device (see the module docstring)."""
NO_DEVICE = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR))


@pytest.fixture(autouse=True)
def plugin_environment(monkeypatch):
    """The plugin writes FSDP_CPU_RAM_EFFICIENT_LOADING into os.environ (for transformers): undone after each test."""
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "unset-by-the-test")


def _config(version: int, sharding: str):
    machines = 2 if sharding == "hybrid_shard" else 1
    topology = {"num_machines": machines, "processes_per_machine": 2}
    if machines > 1:
        topology["main_process_ip"] = "10.0.0.1"
    return validate_config({"strategy": "fsdp", "topology": topology,
                            "fsdp": {"version": version, "sharding": sharding}})


def _on_this_machine(fields: dict) -> dict:
    return {**fields, **DEVICE_BOUND} if fields["fsdp_version"] == 1 and NO_DEVICE else fields


@pytest.mark.parametrize(("version", "sharding"), VARIANTS, ids=[f"fsdp{v}-{s}" for v, s in VARIANTS])
def test_the_plugin_runs_the_configs_fsdp_version_and_sharding(version, sharding, model):
    cfg = _config(version, sharding)
    fields = fsdp.plugin_fields(model, cfg.fsdp.model_dump())
    if version == 1 and NO_DEVICE:
        plugin = FullyShardedDataParallelPlugin(**_on_this_machine(fields))
    else:
        plugin = fsdp.accelerate_plugin(model, cfg.fsdp.model_dump())  # what the manual loop hands the Accelerator
    assert plugin.fsdp_version == version
    if version == 1:
        # What accelerate wraps an FSDP1 model with (Accelerator.prepare_model): sharding_strategy first.
        assert (plugin.sharding_strategy or plugin.reshard_after_forward) == ShardingStrategy[sharding.upper()]
        assert plugin.use_orig_params is True and fields["sync_module_states"] is True
    else:
        assert plugin.reshard_after_forward is (sharding != "shard_grad_op")
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]  # the model's _no_split_modules
    assert fields["cpu_ram_efficient_loading"] is True  # the config's default


_COMPARED = ("fsdp_version", "sharding_strategy", "reshard_after_forward", "state_dict_type", "cpu_offload",
             "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
             "activation_checkpointing", "cpu_ram_efficient_loading", "auto_wrap_policy",
             "transformer_cls_names_to_wrap")


@pytest.mark.parametrize(("version", "sharding"), VARIANTS, ids=[f"fsdp{v}-{s}" for v, s in VARIANTS])
def test_the_plugin_is_the_one_accelerate_launch_builds_from_the_generated_yaml(version, sharding, model, tmp_path,
                                                                                monkeypatch):
    cfg = _config(version, sharding)
    fields = fsdp.plugin_fields(model, cfg.fsdp.model_dump())
    own = FullyShardedDataParallelPlugin(**_on_this_machine(fields))
    (tmp_path / "fsdp.yaml").write_text(accelerate_yaml(cfg, deepspeed_config_file=None, header="t"))
    monkeypatch.chdir(tmp_path)
    with launch_environment("fsdp.yaml", free_port()) as (_, env):
        # The device-bound values, compared as values (FSDP2's plugin ignores FSDP_SYNC_MODULE_STATES).
        assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == str(fields["cpu_ram_efficient_loading"]).lower()
        if version == 1:
            assert env["FSDP_SYNC_MODULE_STATES"] == "true" and fields["sync_module_states"] is True
        device_bound = {f"FSDP_{name.upper()}": "false" for name in DEVICE_BOUND} if version == 1 and NO_DEVICE else {}
        with patch_environment(**device_bound):
            launched = FullyShardedDataParallelPlugin()  # from the FSDP_* variables, as in every launched process
    if version == 1:  # accelerate launch once ran FULL_SHARD for every FSDP1 sharding (no fsdp_sharding_strategy)
        assert (launched.sharding_strategy or launched.reshard_after_forward) == ShardingStrategy[sharding.upper()]
    for plugin in (own, launched):
        plugin.set_auto_wrap_policy(model)  # what accelerate's prepare does: the YAML leaves the classes to the model
    differ = {name: (_comparable(getattr(own, name)), _comparable(getattr(launched, name))) for name in _COMPARED
              if _comparable(getattr(own, name)) != _comparable(getattr(launched, name))}
    assert differ == {}


def _comparable(value):
    """A wrap policy is a new functools.partial in each plugin: its function and arguments."""
    return (value.func, value.keywords) if isinstance(value, functools.partial) else value
