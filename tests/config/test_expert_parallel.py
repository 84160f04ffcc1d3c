"""hf_scale.config.expert_parallel: `parallelism.ep` in the config, its rules (transformers' mesh rules, the strategies
that compose with it, EP within a machine, the model's experts and expert-parallel plan), each one line with exit 2 at
`hf-scale generate`, and the sizes transformers' own DistributedConfig accepts."""

from __future__ import annotations

import pytest
from transformers import Llama4TextConfig, LlamaConfig, MixtralConfig, Qwen3MoeConfig
from transformers.distributed.configuration_utils import DistributedConfig

from hf_scale.commands.cli import main
from hf_scale.config import expert_parallel, parallelism
from hf_scale.config.distributed_config import config_from_data, config_warnings
from hf_scale.config.parallelism import Layout
from hf_scale.errors import UserError


def fsdp(ppm: int = 8, machines: int = 1, strategy: str = "fsdp", **sizes) -> dict:
    topology = {"processes_per_machine": ppm, "num_machines": machines}
    if machines > 1:
        topology["main_process_ip"] = "10.0.0.1"
    return {"strategy": strategy, "topology": topology, "parallelism": sizes}


def test_ep_splits_the_experts_of_the_sharded_ranks_without_changing_the_batch():
    """ep is carved out of dp_shard x tp: the world, the data-parallel size and the batch stay what they were."""
    cfg = config_from_data({**fsdp(tp=2, ep=4), "batch": {"micro_batch_size": 1}})
    assert (cfg.layout.dp_shard, cfg.layout.tp, cfg.layout.ep) == (4, 2, 4)
    assert cfg.layout.world_size == 8 and cfg.layout.data_parallel_size == 4
    assert cfg.batch.global_batch_size == 4
    assert cfg.layout.describe() == "dp_shard=4 x tp=2 (ep=4)"
    assert parallelism.kinds_of(cfg.layout) == ["tp", "ep"]


REFUSALS = [
    (fsdp(ep=3), r"^parallelism.ep=3 must be a multiple of parallelism.tp=1 that divides dp_shard x tp = 8 x 1 = 8 "
                 r".*; allowed ep: 1, 2, 4, 8$"),
    (fsdp(tp=4, ep=2), r"^parallelism.ep=2 must be a multiple of parallelism.tp=4 .*allowed ep: 1, 4, 8$"),
    (fsdp(dp_replicate=2, ep=8), r"dp_shard x tp = 4 x 1 = 4 .*allowed ep: 1, 2, 4$"),
    (fsdp(strategy="deepspeed", ep=2), r"^parallelism.ep=2 with strategy deepspeed: ZeRO partitions every parameter .*"
                                       r"expert_parallel/AutoEP.*use strategy fsdp with fsdp.version=2"),
    (fsdp(strategy="ddp", ep=2), r"^parallelism.ep=2 needs strategy fsdp with fsdp.version=2 \(got strategy=ddp\)"),
    ({**fsdp(ep=2), "fsdp": {"version": 1}}, r"got strategy=fsdp, fsdp.version=1"),
    (fsdp(cp=2, ep=2), r"^parallelism.ep=2 with parallelism.cp=2: .*set one of them to 1$"),
    (fsdp(ppm=4, machines=2, ep=8), r"^parallelism.ep=8 does not fit inside one machine of 4 processes .*allowed: a "
                                    r"divisor of 4, or set parallelism.ep_across_machines=true to accept it$"),
    (fsdp(ep=0), r"parallelism.ep=0 is invalid"),
    (fsdp(ep="2"), r"parallelism.ep='2' is invalid"),
]


@pytest.mark.parametrize("data, message", REFUSALS)
def test_every_ep_refusal_is_one_line_naming_field_value_and_allowed(data, message):
    with pytest.raises(UserError, match=message) as caught:
        config_from_data(data)
    assert "\n" not in str(caught.value)


def test_ep_across_machines_only_with_the_override_and_then_a_warning():
    cfg = config_from_data(fsdp(ppm=4, machines=2, ep=8, ep_across_machines=True))
    assert cfg.layout.ep == 8
    assert any("all-to-alls cross the machines' link" in w for w in config_warnings(cfg))
    assert not config_warnings(config_from_data(fsdp(ppm=4, machines=2, ep=4)))


@pytest.mark.parametrize("dp_shard, tp", [(8, 1), (4, 2), (2, 4), (1, 8), (6, 1), (3, 2)])
def test_the_allowed_sizes_are_the_ones_transformers_distributed_config_accepts(dp_shard, tp):
    """The same rule as transformers' own check (DistributedConfig._validate_mesh_config), asked for every ep."""
    layout = Layout(dp_shard=dp_shard, tp=tp)
    accepted = []
    for ep in range(1, dp_shard * tp + 1):
        try:
            DistributedConfig(tp_size=tp, fsdp_size=dp_shard, ep_size=ep)
        except ValueError:
            continue
        accepted.append(ep)
    assert expert_parallel.allowed_sizes(layout) == accepted


def _qwen3_moe(experts: int = 128) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(num_experts=experts, num_experts_per_tok=8)


def test_the_model_must_be_moe_with_an_ep_plan_and_experts_ep_divides():
    assert expert_parallel.model_problem(4, _qwen3_moe()) is None
    assert expert_parallel.model_problem(1, LlamaConfig()) is None  # no ep: nothing to ask
    assert expert_parallel.model_problem(8, MixtralConfig()) is None
    dense = expert_parallel.model_problem(2, LlamaConfig())
    assert dense == ("parallelism.ep=2 needs a mixture-of-experts model; llama is dense (no num_experts/"
                     "num_local_experts/n_routed_experts in its config): set ep to 1")
    # transformers 5.24 gives Llama 4 no base_model_ep_plan (its experts take router-scaled tokens).
    llama4 = expert_parallel.model_problem(2, Llama4TextConfig(num_local_experts=16))
    assert llama4.startswith("parallelism.ep=2: transformers has no expert-parallel plan for llama4_text "
                             "(base_model_ep_plan is missing")
    assert expert_parallel.model_problem(3, _qwen3_moe(4), "x") == (
        "x.ep=3 does not divide the model's 4 routed experts: each rank holds whole experts; allowed ep: 1, 2, 4")
    assert expert_parallel.expert_counts(_qwen3_moe()) == (128, 8, 0)
    assert expert_parallel.expert_counts(LlamaConfig()) == (None, None, 0)


@pytest.mark.parametrize(
    "override, message",
    [
        (["parallelism.ep=3"], "parallelism.ep=3 must be a multiple of parallelism.tp=2"),
        (["strategy=deepspeed", "parallelism.tp=1", "parallelism.ep=2"], "parallelism.ep=2 with strategy deepspeed"),
    ],
)
def test_generate_refuses_ep_in_one_line_exit_2_and_writes_nothing(tmp_path, capsys, override, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--preset", "fsdp2_tp", *[f"--set={o}" for o in override], "--output-dir", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_generate_writes_an_ep_config_that_loads_back(tmp_path):
    out = tmp_path / "out"
    main(["generate", "--preset", "fsdp2_tp", "--set", "parallelism.ep=4", "--output-dir", str(out)])
    written = next((out / "hf_scale_configs").glob("*.yaml"))
    from hf_scale.config.distributed_config import load_config

    assert load_config(written).layout.ep == 4


def test_generate_auto_refuses_an_ep_the_models_experts_rule_out(tmp_path, capsys):
    """--strategy auto knows the model: an ep its 6 experts cannot split over is refused as train.py would."""
    model = tmp_path / "moe"
    Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                   num_experts_per_tok=2, vocab_size=128).save_pretrained(model)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--strategy", "auto", "--model", str(model), "--gpu-memory", "80GiB", "--set",
              "strategy=fsdp", "--set", "parallelism.ep=4", "--output-dir", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "parallelism.ep=4 does not divide the model's 6 routed experts" in err and "allowed ep: 1, 2, 3, 6" in err
    assert not out.exists()
