"""hf_scale.config.parallelism: the `parallelism` section of DistributedConfig, its rules, accelerate's
`parallelism_config:` block (loaded back by accelerate's loader and built into its own ParallelismConfig), the
fsdp2_tp / fsdp2_cp presets and the one-line refusals of `hf-scale generate`."""

from __future__ import annotations

import os
import sys

import pytest
import yaml

from hf_scale.commands.cli import main
from hf_scale.config import parallelism
from hf_scale.config.distributed_config import config_from_data, config_warnings
from hf_scale.config.parallelism import Layout, head_problem
from hf_scale.config.presets import get_preset
from hf_scale.errors import UserError
from hf_scale.generators import render_files


def fsdp(ppm: int = 8, machines: int = 1, **sizes) -> dict:
    topology = {"processes_per_machine": ppm, "num_machines": machines}
    if machines > 1:
        topology["main_process_ip"] = "10.0.0.1"
    return {"strategy": "fsdp", "topology": topology, "parallelism": sizes}


@pytest.mark.parametrize(
    "data, sizes",
    [
        (fsdp(tp=2), (1, 4, 2, 1, 1)),
        (fsdp(cp=4), (1, 2, 1, 4, 1)),
        (fsdp(machines=2, tp=4), (1, 4, 4, 1, 1)),
        ({**fsdp(machines=2, tp=2), "fsdp": {"sharding": "hybrid_shard"}}, (2, 4, 2, 1, 1)),
        (fsdp(dp_replicate=2, tp=2), (2, 2, 2, 1, 1)),
        ({"strategy": "ddp", "topology": {"processes_per_machine": 2}, "parallelism": {"tp": 2}}, (1, 1, 2, 1, 1)),
        ({"strategy": "deepspeed", "topology": {"processes_per_machine": 8}, "parallelism": {"sp": 4}},
         (1, 2, 1, 1, 4)),
        ({"strategy": "ddp", "topology": {"processes_per_machine": 8}}, (8, 1, 1, 1, 1)),
    ],
)
def test_left_out_sizes_are_derived_and_multiply_to_the_world_size(data, sizes):
    cfg = config_from_data(data)
    assert tuple(cfg.layout.sizes().values()) == sizes
    assert cfg.layout.world_size == cfg.world_size


def test_the_batch_counts_data_parallel_ranks_only():
    """The ranks of one TP group see the same batch: 8 GPUs at tp=2 are 4 data-parallel ranks."""
    cfg = config_from_data({**fsdp(tp=2), "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 3}})
    assert cfg.layout.data_parallel_size == 4
    assert cfg.batch.global_batch_size == 2 * 3 * 4
    with pytest.raises(UserError, match=r"x data_parallel_size\(4\)"):
        config_from_data({**fsdp(tp=2), "batch": {"global_batch_size": 6, "micro_batch_size": 1}})


REFUSALS = [
    (fsdp(tp=3), r"parallelism: dp_replicate\(1\) x dp_shard\(\?\) x tp\(3\) .* must multiply to the world size 8"),
    (fsdp(tp=2, dp_shard=2), r"dp_shard\(2\) x tp\(2\).* must multiply to the world size 8"),
    (fsdp(machines=2, tp=16, dp_shard=1, cp=1),
     r"nothing to shard over"),
    (fsdp(ppm=4, machines=4, tp=8), r"parallelism.tp=8 does not fit inside one machine of 4 processes .* "
     r"parallelism.tp_across_machines=true"),
    (fsdp(ppm=6, machines=2, tp=4), r"tp must divide topology.processes_per_machine=6"),
    (fsdp(cp=2, sp=2), r"parallelism.cp=2 and parallelism.sp=2 together"),
    ({**fsdp(cp=2), "fsdp": {"version": 1}}, r"parallelism.cp=2 needs strategy fsdp with fsdp.version=2"),
    ({"strategy": "ddp", "topology": {"processes_per_machine": 8}, "parallelism": {"cp": 2}},
     r"parallelism.cp=2 needs strategy fsdp .*got strategy=ddp"),
    ({"strategy": "deepspeed", "topology": {"processes_per_machine": 8}, "parallelism": {"tp": 2}},
     r"parallelism.tp=2 with strategy deepspeed: ZeRO"),
    ({"strategy": "ddp", "topology": {"processes_per_machine": 8}, "parallelism": {"tp": 2}},
     r"parallelism.tp=2 with strategy ddp and dp_replicate=4: accelerate cannot compose DDP and TP"),
    ({"strategy": "ddp", "topology": {"processes_per_machine": 8}, "parallelism": {"dp_shard": 4, "tp": 2}},
     r"parallelism.dp_shard=4 with strategy ddp: DDP keeps a whole copy .* allowed with ddp: dp_shard=1"),
    ({"strategy": "ddp", "topology": {"processes_per_machine": 8}, "parallelism": {"dp_shard": 4,
                                                                                  "dp_replicate": 2}},
     r"parallelism.dp_shard=4 with strategy ddp"),
    ({"strategy": "deepspeed", "topology": {"processes_per_machine": 8}, "parallelism": {"dp_replicate": 2}},
     r"parallelism.dp_replicate=2 with strategy deepspeed: .* allowed with deepspeed: dp_replicate=1"),
    ({**fsdp(tp=2), "fsdp": {"version": 1}}, r"parallelism.tp=2 needs fsdp.version=2"),
    (fsdp(sp=2), r"parallelism.sp=2 needs strategy deepspeed \(got fsdp\)"),
    (fsdp(tp=8), r"strategy fsdp with dp_shard=1 and cp=1 leaves FSDP2 nothing to shard over"),
    (fsdp(dp_replicate=4, dp_shard=1, tp=2), r"dp_replicate=4 with dp_shard=1"),
    (fsdp(tp=0), r"parallelism.tp=0 is invalid"),
    (fsdp(tp="2"), r"parallelism.tp='2' is invalid"),
    (fsdp(tpp=2), r"unknown key parallelism.tpp: did you mean parallelism.tp\?"),
    ({"strategy": "single", "parallelism": {"tp": 2}}, r"must multiply to the world size 1"),
]


@pytest.mark.parametrize("data, message", REFUSALS)
def test_every_refusal_is_one_line_naming_field_value_and_allowed(data, message):
    with pytest.raises(UserError, match=message) as caught:
        config_from_data(data)
    assert "\n" not in str(caught.value)


def test_tp_across_machines_only_with_the_override_and_then_a_warning():
    cfg = config_from_data(fsdp(ppm=4, machines=2, tp=8, cp=1, tp_across_machines=True, dp_shard=1)
                           | {"strategy": "ddp"})
    assert cfg.layout.tp == 8
    assert any("cross the machines' link" in w for w in config_warnings(cfg))
    assert not any("machines' link" in w for w in config_warnings(config_from_data(fsdp(tp=2))))


def test_heads_must_split_over_tp_and_sp():
    assert head_problem(Layout(tp=4), 32, 8) is None
    assert "num_key_value_heads=8" in head_problem(Layout(tp=16), 32, 8)
    assert "allowed tp: 1, 2, 4" in head_problem(Layout(tp=8), 4, 4)
    problem = head_problem(Layout(sp=3), 12, 4)
    assert problem.startswith("parallelism.sp=3 does not divide the model's num_key_value_heads=4")
    assert "allowed sp: 1, 2, 4" in problem


# --- accelerate reads what generate writes -----------------------------------------------------------------


def _generated_yaml(tmp_path, cfg, name="run"):
    files = render_files(cfg, name=name, deepspeed_mode="auto", header="t")
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path / f"accelerate_configs/{name}.yaml"


@pytest.mark.parametrize(
    "data",
    [fsdp(tp=2), fsdp(cp=2, cp_comm_strategy="alltoall"), fsdp(machines=2, dp_replicate=2, tp=2),
     {"strategy": "ddp", "topology": {"processes_per_machine": 4}, "parallelism": {"tp": 4}}],
    ids=["fsdp2_tp", "fsdp2_cp", "hsdp_tp", "pure_tp"],
)
def test_the_block_is_what_accelerate_config_writes_and_builds_accelerates_parallelism_config(tmp_path, data):
    from accelerate import ParallelismConfig
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = config_from_data(data)
    path = _generated_yaml(tmp_path, cfg)
    loaded = load_config_from_file(str(path))  # accelerate's own loader
    block = loaded.parallelism_config
    # The keys of `accelerate config` (commands/config/cluster.py): four sizes, plus the CP strategy with cp > 1.
    expected = {f"parallelism_config_{name}_size" for name in ("dp_replicate", "dp_shard", "tp", "cp")}
    assert set(block) == expected | ({"parallelism_config_cp_comm_strategy"} if cfg.layout.cp > 1 else set())
    built = ParallelismConfig(**{f"{name}_size": block[f"parallelism_config_{name}_size"]
                                 for name in ("dp_replicate", "dp_shard", "tp", "cp")})
    assert built._sizes == cfg.layout.sizes()
    assert built.total_size == loaded.num_processes == cfg.world_size
    assert built.data_parallel_size == cfg.layout.data_parallel_size
    if cfg.layout.cp > 1:
        assert built.cp_handler.cp_comm_strategy == "allgather"  # the handler reads the env; the YAML key:
        assert block["parallelism_config_cp_comm_strategy"] == "alltoall"
    assert parallelism.layout_from_yaml_block(block) == cfg.layout


def test_sp_writes_the_keys_accelerate_launch_reads(tmp_path):
    from accelerate.commands.launch import launch_command_parser

    cfg = config_from_data({"strategy": "deepspeed", "topology": {"processes_per_machine": 4},
                            "parallelism": {"sp": 2}})
    block = yaml.safe_load(_generated_yaml(tmp_path, cfg).read_text())["parallelism_config"]
    assert block["parallelism_config_sp_size"] == 2 and block["parallelism_config_sp_backend"] == "deepspeed"
    options = {action.dest for action in launch_command_parser()._actions}
    assert set(block) <= options  # `accelerate launch` copies each onto an option of its own name


def test_no_block_without_tp_cp_sp_or_hsdp(tmp_path):
    for name in ("ddp", "zero3", "fsdp2_full_shard"):
        assert "parallelism_config" not in yaml.safe_load(_generated_yaml(tmp_path, get_preset(name), name).read_text())


def test_presets_fsdp2_tp_and_fsdp2_cp():
    tp, cp = get_preset("fsdp2_tp").layout, get_preset("fsdp2_cp").layout
    assert (tp.dp_shard, tp.tp, tp.world_size) == (4, 2, 8)
    assert (cp.dp_shard, cp.cp, cp.world_size) == (4, 2, 8)


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallelism.tp=3", "must multiply to the world size 8"),
        ("parallelism.sp=2", "parallelism.sp=2 needs strategy deepspeed (got fsdp)"),
        ("fsdp.version=1", "parallelism.tp=2 needs fsdp.version=2"),
    ],
)
def test_generate_refuses_in_one_line_exit_2_and_writes_nothing(tmp_path, capsys, override, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--preset", "fsdp2_tp", "--set", override, "--output-dir", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_version_problem_names_the_version_needed(monkeypatch):
    assert parallelism.version_problem("tp") is None  # this node's torch 2.13 / accelerate 1.15 / transformers 5
    monkeypatch.setitem(parallelism.NEEDS, "cp", {"torch": "99.0"})
    assert parallelism.version_problem("cp").startswith("cp needs torch >= 99.0 (")
    monkeypatch.setitem(parallelism.NEEDS, "sp", {"no-such-package-hf-scale": "1.0"})
    assert "not installed" in parallelism.version_problem("sp")
    monkeypatch.setitem(parallelism.NEEDS, "tp", {**parallelism.NEEDS["tp"], "python": "99.0"})
    problem = parallelism.version_problem("tp")
    assert problem.startswith("tp needs Python >= 99.0 (3.")
    assert "transformers >= 5.24.0 requires it): run it from a Python >= 99.0 environment" in problem


def test_accelerate_launch_sizes_are_taken_over_by_train_py(monkeypatch):
    """`accelerate launch` with a parallelism_config block sets PARALLELISM_CONFIG_*: tp/cp/sp become the request's
    layout (--hf_scale_config must say the same; cp without a GPU is refused there, before loading), and accelerate's
    own ParallelismConfig (and, under TP, its FSDP plugin) are turned off: train.py builds the mesh from
    --hf_scale_config, as under torchrun."""
    from hf_scale.train.setup.distributed import detect_launch

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("WORLD_SIZE", "4")
    request = detect_launch(None)
    assert (request.layout, request.cp_comm_strategy, request.strategy) == (
        parallelism.Layout(dp_shard=2, cp=2), "alltoall", "fsdp")
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false" and os.environ["ACCELERATE_USE_FSDP"] == "true"
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    request = detect_launch(None)
    assert (request.layout, request.strategy) == (parallelism.Layout(dp_shard=2, tp=2), "fsdp")
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == os.environ["ACCELERATE_USE_FSDP"] == "false"


def test_train_runs_tp_sp_and_cp_on_gpus_and_refuses_cp_on_cpu():
    """What train.py runs of each kind (the CPU reason is a measured fact: parallelism.train_refusal)."""
    tp, cp, sp = parallelism.Layout(tp=2), parallelism.Layout(dp_shard=2, cp=2), parallelism.Layout(sp=2)
    assert parallelism.train_refusal(tp, "x", gpu_present=False) is None
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in parallelism.train_refusal(cp, "x", gpu_present=False)
    assert parallelism.train_refusal(cp, "x", gpu_present=True) is None
    assert parallelism.train_refusal(sp, "x", gpu_present=False) is None


def test_tp_with_cp_is_refused_by_the_config_with_hf_scales_reason():
    """accelerate composes TP and CP on its own mesh; train.py's TP is transformers' (built at load): one of them."""
    with pytest.raises(UserError, match="hf_scale's train.py runs TP or CP, not both"):
        config_from_data({"strategy": "fsdp", "topology": {"processes_per_machine": 8},
                          "parallelism": {"tp": 2, "cp": 2}})


def test_train_py_judges_the_launched_sizes_and_a_config_must_say_the_same(tmp_path):
    """accelerate launch's parallelism_config without --hf_scale_config is judged by the config rules (here: sizes
    for 4 ranks in one process), with a config of other sizes refused: one line, exit 2, before anything is
    loaded."""
    from train_helpers import TRAIN_PY, child_env, run

    env = {**child_env(), "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
           "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}
    command = [sys.executable, TRAIN_PY, "--output_dir", str(tmp_path / "out")]
    result = run(command, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert ("the accelerate config's parallelism_config: strategy single runs one process; sizes dp_shard=2 x tp=2 "
            "need several") in result.stderr
    config = tmp_path / "tp2.yaml"
    config.write_text("strategy: ddp\ntopology: {processes_per_machine: 2}\nparallelism: {tp: 2}\n")
    result = run(command + ["--hf_scale_config", str(config)], env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "parallelism tp=2 but the accelerate config's parallelism_config has dp_shard=2 x tp=2" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("launched", "message"), [
    ({"WORLD_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"},
     "the accelerate config's parallelism_config.dp_shard=2 with strategy ddp: DDP keeps a whole copy"),
    ({"WORLD_SIZE": "4", "ACCELERATE_USE_DEEPSPEED": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
      "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"},
     "the accelerate config's parallelism_config.dp_replicate=2 with strategy deepspeed: ZeRO partitions"),
], ids=["ddp-dp-shard", "deepspeed-dp-replicate"])
def test_train_py_refuses_a_launched_layout_by_the_config_rules(launched, message, tmp_path):
    """The sizes accelerate launch exports from a MULTI_GPU / DEEPSPEED YAML are judged by layout_problems, as a
    config's are: one line, exit 2, before the process group (rank 0 of a world that never forms)."""
    from train_helpers import TRAIN_PY, child_env, run

    env = {**child_env(), "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
           "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", **launched}
    result = run([sys.executable, TRAIN_PY, "--output_dir", str(tmp_path / "out")], env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert message in result.stderr
    assert not (tmp_path / "out").exists()
