"""Peer projects' accelerate YAMLs with a parallelism_config (tests/data/peer_configs: TRL's context-parallel and
ALST/Ulysses configs, accelerate's torch_native_parallelism examples), run by train.py without --hf_scale_config:
the layout, the CP/SP backend and the FSDP plugin come from the YAML, through the variables `accelerate launch`
itself exports for it (its own launch code builds them here), judged by the rules a config's layout is."""

from __future__ import annotations

import pytest
from train_helpers import REPO

from hf_scale.config.parallelism import Layout
from hf_scale.errors import UserError
from hf_scale.train.setup import distributed, reconcile

PEERS = REPO / "tests" / "data" / "peer_configs"

# file -> (the layout, the strategy accelerate launches, the FSDP settings train.py hands transformers under TP)
EXPECTED = {
    "trl_context_parallel_2gpu.yaml": (Layout(cp=2), "fsdp", None),
    "trl_alst_ulysses_4gpu.yaml": (Layout(dp_shard=2, sp=2), "deepspeed", None),
    "accelerate_nd.yaml": (Layout(dp_shard=2, tp=2, cp=2), "fsdp", {"version": 2, "state_dict_type": "sharded"}),
    "accelerate_cp.yaml": (Layout(cp=8), "fsdp", None),
    "accelerate_tp_hsdp.yaml": (Layout(dp_replicate=2, dp_shard=2, tp=2), "fsdp",
                                {"version": 2, "state_dict_type": "sharded"}),
}


def launched_env(yaml_file) -> dict[str, str]:
    """What `accelerate launch --config_file YAML train.py` gives rank 0: accelerate's own parser and launch code, as
    `hf-scale check` runs them (check.inputs.accelerate_launch_env); torchrun adds the ranks."""
    import yaml

    from hf_scale.check.inputs import accelerate_launch_env

    env, error = accelerate_launch_env(yaml_file, yaml.safe_load(yaml_file.read_text()))
    assert env is not None, error
    launched = {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}
    processes = env.get("WORLD_SIZE") or str(yaml.safe_load(yaml_file.read_text()).get("num_processes", 1))
    return {**launched, "WORLD_SIZE": processes, "LOCAL_WORLD_SIZE": processes, "RANK": "0", "LOCAL_RANK": "0"}


@pytest.fixture
def launched(monkeypatch):
    def start(name: str):
        for key, value in launched_env(PEERS / name).items():
            monkeypatch.setenv(key, value)
        from hf_scale.train.prepare import _parse

        parsed, given, _ = _parse(["--output_dir", "out"])
        return parsed, given

    return start


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_layout_comes_from_the_yaml(name, launched):
    import os

    layout, strategy, fsdp = EXPECTED[name]
    parsed, _ = launched(name)
    request = distributed.detect_launch(None)
    assert (request.layout, request.strategy) == (layout, strategy)
    got = reconcile.apply_launched_layout(request, parsed, os.environ, gpu_present=True)
    assert got.layout == layout and (got.cp_comm_strategy == "allgather" or layout.cp == 1)
    if fsdp is None:
        assert got.fsdp_settings is None
    else:
        assert {key: got.fsdp_settings[key] for key in fsdp} == fsdp


# What the prepare stage says on this CPU machine: tp and sp layouts are taken; cp has no CPU kernel; TP with CP is
# hf_scale's own refusal (check says the same). Never "needs --hf_scale_config".
ON_CPU = {
    "trl_context_parallel_2gpu.yaml": "the accelerate config's parallelism_config: cp=2 cannot run on this machine",
    "trl_alst_ulysses_4gpu.yaml": "the accelerate config's parallelism_config.sp_attn_implementation="
                                  "flash_attention_2: hf_scale runs Ulysses (sp=2) around sdpa only; allowed: sdpa "
                                  "(or leave it unset)",
    "accelerate_nd.yaml": "the accelerate config's parallelism_config.tp=2 with the accelerate config's "
                          "parallelism_config.cp=2: hf_scale's train.py runs TP or CP, not both",
    "accelerate_cp.yaml": "the accelerate config's parallelism_config: cp=8 cannot run on this machine",
    "accelerate_tp_hsdp.yaml": None,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_train_py_takes_the_yaml_or_says_what_hf_scale_or_this_machine_lacks(name, launched):
    """train.py's prepare stage itself (no --hf_scale_config)."""
    import re

    from hf_scale.train.prepare import _reconcile_with_launcher

    if distributed.has_gpu():
        pytest.skip("a GPU machine: the refusals for this machine's lack of one do not apply")
    parsed, given = launched(name)
    if ON_CPU[name] is not None:
        with pytest.raises(UserError, match=re.escape(ON_CPU[name])):
            _reconcile_with_launcher(parsed, given)
        return
    assert _reconcile_with_launcher(parsed, given).request.layout == EXPECTED[name][0]


def test_the_fsdp_settings_read_back_are_the_ones_the_generator_wrote(tmp_path):
    """One table both ways: a config's fsdp section -> the generated YAML's fsdp_config -> the variables accelerate
    launch exports -> the same fsdp section."""
    import yaml

    from hf_scale.config.distributed_config import DistributedConfig
    from hf_scale.contract.accelerate_fsdp import fsdp_settings_from_launch
    from hf_scale.generators.accelerate_yaml import accelerate_config

    for fsdp in ({}, {"sharding": "shard_grad_op", "offload_params": True, "state_dict_type": "full",
                      "cpu_ram_efficient_loading": False, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
                 {"version": 1, "sharding": "shard_grad_op", "activation_checkpointing": True}):
        cfg = DistributedConfig.model_validate({"strategy": "fsdp", "topology": {"processes_per_machine": 2},
                                                "fsdp": fsdp})
        path = tmp_path / "fsdp.yaml"
        path.write_text(yaml.safe_dump(accelerate_config(cfg, deepspeed_config_file=None)))
        assert fsdp_settings_from_launch(launched_env(path)) == cfg.fsdp


def test_ulysses_runs_around_the_kernel_the_yaml_names_or_is_refused(tmp_path, monkeypatch):
    """The YAML's sp_attn_implementation: sdpa (hf_scale's) is taken; another kernel is one line naming the field, the
    value and what is allowed, never Ulysses on sdpa behind the YAML's back."""
    import re

    import yaml

    from hf_scale.train.prepare import _parse, _reconcile_with_launcher

    trl = yaml.safe_load((PEERS / "trl_alst_ulysses_4gpu.yaml").read_text())
    refused = "sp_attn_implementation=flash_attention_3: hf_scale runs Ulysses (sp=2) around sdpa only; allowed: sdpa"
    for attn, refusal in (("sdpa", None), ("flash_attention_3", refused)):
        trl["parallelism_config"]["parallelism_config_sp_attn_implementation"] = attn
        path = tmp_path / f"{attn}.yaml"
        path.write_text(yaml.safe_dump(trl))
        for key, value in launched_env(path).items():
            monkeypatch.setenv(key, value)
        parsed, given, _ = _parse(["--output_dir", str(tmp_path / "out")])
        if refusal is None:
            assert _reconcile_with_launcher(parsed, given).request.sp_attn_implementation == "sdpa"
        else:
            with pytest.raises(UserError, match=re.escape(refusal)):
                _reconcile_with_launcher(parsed, given)
