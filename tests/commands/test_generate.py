"""`hf-scale generate / presets / schema` through the real CLI, including a corpus of bad input that must
give one stderr line naming the field, exit code 2 and no written file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_scale.commands.cli import main
from hf_scale.config.presets import PRESETS

# (argv after `hf-scale`, with OUT for the output dir and CFG for a config file; CFG's content; fragment)
BAD_INPUT = [
    (["generate"], None, "give a CONFIG.yaml or --preset"),
    (["generate", "--preset", "zero4"], None, "--preset 'zero4' is unknown; allowed: single_gpu"),
    (["generate", "--preset", "zero3", "--deepspeed-mode", "magic"], None, "argument --deepspeed-mode"),
    (["generate", "--preset", "zero3", "--name", "../escape"], None, "--name '../escape' is invalid"),
    (["generate", "--preset", "zero3", "--name", ""], None, "--name '' is invalid"),
    (["generate", "--preset", "zero3", "--bogus"], None, "unrecognized arguments: --bogus"),
    (["generate", "--preset"], None, "argument --preset: expected one argument"),
    (["frobnicate"], None, "argument COMMAND: invalid choice: 'frobnicate'"),
    (["generate", "CFG", "--preset", "zero3"], "strategy: ddp\n", "not both"),
    (["generate", "OUT/missing.yaml"], None, "missing.yaml: not found"),
    (
        ["generate", "--preset", "zero3", "--set", "novalue"],
        None,
        "--set 'novalue' is invalid: expected KEY=VALUE",
    ),
    (["generate", "--preset", "zero3", "--set", "deepspeed.zero_stage=4"], None, "deepspeed.zero_stage=4"),
    (
        ["generate", "--preset", "zero3", "--set", "deepspeed.zero_stage=two"],
        None,
        "deepspeed.zero_stage='two'",
    ),
    (
        ["generate", "--preset", "zero2", "--set", "deepspeed.offload_params=cpu"],
        None,
        "deepspeed.offload_params=cpu needs deepspeed.zero_stage=3",
    ),
    (
        ["generate", "--preset", "zero2", "--set", "deepspeed.offload_optimizer=disk"],
        None,
        "deepspeed.offload_optimizer='disk'",
    ),
    (
        [
            "generate",
            "--preset",
            "zero1",
            "--set",
            "deepspeed.zero_stage=0",
            "--set",
            "deepspeed.offload_optimizer=cpu",
        ],
        None,
        "deepspeed.offload_optimizer=cpu needs deepspeed.zero_stage 1, 2 or 3",
    ),
    (
        ["generate", "--preset", "zero3", "--set", "deepspeed.offload_params=nvme"],
        None,
        "deepspeed.nvme_path is required",
    ),
    (
        [
            "generate",
            "--preset",
            "zero2",
            "--set",
            "deepspeed.offload_optimizer=nvme",
            "--set",
            "deepspeed.nvme_path=/n",
        ],
        None,
        "deepspeed.offload_optimizer=nvme needs deepspeed.zero_stage=3",
    ),
    (
        ["generate", "--preset", "ddp", "--set", "bf16=true", "--set", "fp16=true"],
        None,
        "bf16=true and fp16=true",
    ),
    (["generate", "--preset", "ddp", "--set", "precision=fp32"], None, "precision='fp32'"),
    (
        ["generate", "--preset", "zero3", "--set", "precision=bf16", "--set", "fp16=true"],
        None,
        "fp16=true disagrees with precision='bf16'",
    ),
    (
        ["generate", "--preset", "fsdp2_full_shard", "--set", "fsdp.sharding=hybrid_shard"],
        None,
        "fsdp.sharding=hybrid_shard needs topology.num_machines >= 2",
    ),
    (
        ["generate", "--preset", "fsdp2_full_shard", "--set", "fsdp.sharding=no_shard"],
        None,
        "fsdp.sharding=no_shard",
    ),
    (["generate", "--preset", "fsdp2_full_shard", "--set", "fsdp.version=3"], None, "fsdp.version=3"),
    (
        ["generate", "--preset", "fsdp2_full_shard", "--set", "fsdp.state_dict_type=local"],
        None,
        "fsdp.state_dict_type='local'",
    ),
    (
        [
            "generate",
            "--preset",
            "fsdp2_full_shard",
            "--set",
            "activation_checkpointing=true",
            "--set",
            "fsdp.activation_checkpointing=true",
        ],
        None,
        "fsdp.activation_checkpointing=true and",
    ),
    (
        ["generate", "--preset", "ddp", "--set", "batch.global_batch_size=30"],
        None,
        "batch.global_batch_size=30 is not micro_batch_size(1)",
    ),
    (["generate", "--preset", "ddp", "--set", "batch.micro_batch_size=0"], None, "batch.micro_batch_size=0"),
    (
        [
            "generate",
            "--preset",
            "ddp",
            "--set",
            "batch.global_batch_size=64",
            "--set",
            "batch.micro_batch_size=2",
            "--set",
            "batch.gradient_accumulation_steps=2",
        ],
        None,
        "batch.global_batch_size=64 is not",
    ),
    (
        ["generate", "--preset", "ddp", "--set", "topology.processes_per_machine=0"],
        None,
        "topology.processes_per_machine=0",
    ),
    (["generate", "--preset", "ddp", "--set", "topology.num_machines=0"], None, "topology.num_machines=0"),
    (
        ["generate", "--preset", "ddp", "--set", "topology.main_process_port=70000"],
        None,
        "topology.main_process_port=70000",
    ),
    (
        ["generate", "--preset", "ddp", "--set", "topology.main_process_port=-1"],
        None,
        "topology.main_process_port=-1",
    ),
    (
        ["generate", "--preset", "ddp_multinode", "--set", "topology.machine_rank=2"],
        None,
        "topology.machine_rank=2 is out of range: allowed 0..1",
    ),
    (
        ["generate", "--preset", "ddp", "--set", "topology.num_machines=2"],
        None,
        "topology.main_process_ip is required",
    ),
    (
        ["generate", "--preset", "single_gpu", "--set", "topology.processes_per_machine=4"],
        None,
        "strategy=single runs one process",
    ),
    (["generate", "--preset", "ddp", "--set", "strategy=horovod"], None, "strategy='horovod'"),
    (
        ["generate", "--preset", "ddp", "--set", "topology.rdzv_backend=etcd"],
        None,
        "topology.rdzv_backend='etcd'",
    ),
    (["generate", "--preset", "ddp", "--set", "optimizer.lr=0"], None, "optimizer.lr=0"),
    (["generate", "--preset", "ddp", "--set", "optimizer.betas=[0.9,1.0]"], None, "optimizer.betas[1]=1.0"),
    (["generate", "--preset", "ddp", "--set", "optimizer.betas=[0.9"], None, "not valid YAML"),
    (["generate", "--preset", "ddp", "--set", "gradient_clipping=-1"], None, "gradient_clipping=-1"),
    (
        ["generate", "--preset", "ddp", "--set", "deepspeed.zero_stag=3"],
        None,
        "unknown key deepspeed.zero_stag: did you mean deepspeed.zero_stage?",
    ),
    (
        ["generate", "--preset", "ddp", "--set", "optimiser.lr=1"],
        None,
        "unknown key optimiser: did you mean optimizer?",
    ),
    (
        ["generate", "--preset", "ddp", "--set", "deepspeed.reduce_bucket_size=huge"],
        None,
        "deepspeed.reduce_bucket_size='huge'",
    ),
    (["generate", "--preset", "ddp", "--set", "strategy.kind=x"], None, "strategy is a value"),
    (["generate", "CFG"], "strategy: [unclosed\n", "not valid YAML at line 2"),
    (["generate", "CFG"], "- a\n- b\n", "the top level must be a mapping"),
    (["generate", "CFG"], "strategy: deepspeed\ndeepspeed:\n  zero_stage: 5\n", "deepspeed.zero_stage=5"),
    (
        ["generate", "CFG"],
        "strategy: ddp\ntopology:\n  processes_per_machine: 8\nbatch:\n  global_batch_size: 12\n",
        "batch.global_batch_size=12",
    ),
    (["generate", "CFG"], "fsdp: [full_shard]\n", "fsdp=['full_shard'] is invalid"),
    (
        ["generate", "CFG"],
        "strategy: ddp\ntopology: {processes_per_machine: 2, gpus: 2}\n",
        "unknown key topology.gpus",
    ),
]


def prepare(argv: list[str], content: str | None, out: Path) -> list[str]:
    config = out.parent / "run.yaml"
    if content is not None:
        config.write_text(content)
    argv = [str(config) if arg == "CFG" else arg.replace("OUT", str(out)) for arg in argv]
    if argv and argv[0] == "generate":
        argv += ["--output-dir", str(out)]
    return argv


def written_files(out: Path) -> list[Path]:
    return [path for path in out.rglob("*") if path.is_file()] if out.exists() else []


def test_the_bad_input_corpus_is_large_enough():
    assert len(BAD_INPUT) >= 40


@pytest.mark.parametrize(
    ("argv", "content", "fragment"), BAD_INPUT, ids=[str(i) for i in range(len(BAD_INPUT))]
)
def test_bad_input_gives_one_line_exit_2_and_writes_nothing(argv, content, fragment, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(prepare(argv, content, out))
    assert exited.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(("hf-scale: error: ", "hf-scale generate: error: ")), lines[0]
    assert fragment in lines[0]
    assert captured.out == ""
    assert written_files(out) == []


@pytest.mark.parametrize("index", [0, 3, 11, 21, 26, 35, 46])
def test_bad_input_through_the_installed_entry_point_has_no_traceback(index, tmp_path):
    argv, content, fragment = BAD_INPUT[index]
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "hf_scale", *prepare(argv, content, out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and fragment in result.stderr
    assert written_files(out) == []


def test_output_dir_that_is_a_file_is_rejected(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--preset", "ddp", "--output-dir", str(target)])
    assert exited.value.code == 2
    assert "is not a directory" in capsys.readouterr().err
    assert target.read_text() == "x"


def test_generate_writes_and_reports_every_file(tmp_path, capsys):
    assert main(["generate", "--preset", "zero3_offload", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    expected = [
        "ds_configs/zero3_offload.json",
        "accelerate_configs/zero3_offload.yaml",
        "hf_scale_configs/zero3_offload.yaml",
        "launch/zero3_offload.accelerate.sh",
        "launch/zero3_offload.torchrun.sh",
        "launch/zero3_offload.deepspeed.sh",
        "launch/zero3_offload.sbatch",
    ]
    for rel_path in expected:
        assert (tmp_path / rel_path).is_file()
        assert f"wrote {tmp_path / rel_path}" in out
    assert sorted(str(p.relative_to(tmp_path)) for p in written_files(tmp_path)) == sorted(expected)
    assert "world_size=8" in out


def test_rerun_leaves_identical_files_and_refuses_to_replace_edited_ones(tmp_path, capsys):
    argv = ["generate", "--preset", "ddp", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    assert main(argv) == 0
    assert "unchanged" in capsys.readouterr().out
    yaml_path = tmp_path / "accelerate_configs" / "ddp.yaml"
    yaml_path.write_text("# my edits\n")
    sbatch = tmp_path / "launch" / "ddp.sbatch"
    sbatch.unlink()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "pass --force" in capsys.readouterr().err
    assert yaml_path.read_text() == "# my edits\n"
    assert not sbatch.exists()  # nothing was written, not even the missing file
    assert main([*argv, "--force"]) == 0
    assert yaml_path.read_text().startswith("# Generated by hf-scale")


def test_warnings_go_to_stderr_and_do_not_fail(tmp_path, capsys):
    argv = [
        "generate",
        "--preset",
        "zero3",
        "--set",
        "deepspeed.gather_16bit_weights_on_save=false",
        "--output-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("hf-scale: warning: deepspeed.gather_16bit_weights_on_save=false")


def test_config_file_name_options_and_mode_appear_in_the_regenerate_header(tmp_path, capsys):
    config = tmp_path / "my run.yaml"
    config.write_text("strategy: deepspeed\ntopology:\n  processes_per_machine: 2\n")
    out = tmp_path / "out"
    assert (
        main(
            [
                "generate",
                str(config),
                "--set",
                "batch.global_batch_size=8",
                "--deepspeed-mode",
                "resolved",
                "--name",
                "custom",
                "--output-dir",
                str(out),
            ]
        )
        == 0
    )
    header = (out / "accelerate_configs" / "custom.yaml").read_text().splitlines()[1]
    assert header == (
        f"#   hf-scale generate '{config}' --set batch.global_batch_size=8 --name custom "
        "--deepspeed-mode resolved --output-dir ."
    )
    ds = json.loads((out / "ds_configs" / "custom.json").read_text())
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 4
    assert (out / "launch" / "custom.sbatch").read_text().count(header) == 1


def test_default_name_is_the_config_file_stem(tmp_path, capsys):
    config = tmp_path / "experiment.yaml"
    config.write_text("strategy: ddp\ntopology:\n  processes_per_machine: 2\n")
    assert main(["generate", str(config), "--output-dir", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "accelerate_configs" / "experiment.yaml").is_file()
    assert not (tmp_path / "o" / "ds_configs").exists()


def test_presets_lists_every_preset_with_its_description(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "STRATEGY", "PROCESSES", "PLANNED", "DESCRIPTION"]
    for name, preset in PRESETS.items():
        assert any(line.startswith(name + " ") and line.endswith(preset.description) for line in out)


def test_schema_prints_the_json_schema(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"strategy", "precision", "batch", "topology", "deepspeed", "fsdp", "optimizer"} <= set(
        schema["properties"]
    )


@pytest.mark.parametrize("command", [[], ["generate"], ["presets"], ["schema"]])
def test_every_command_has_help_with_examples(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "usage: hf-scale" in out
    assert "example" in out.lower() or command == []


def test_repeated_targets_add_up(tmp_path, capsys):
    """`--targets ray --targets docker` writes both (a later --targets used to replace an earlier one silently), each
    once, and the header's command reproduces them."""
    image = "--set=cluster.image=registry.example.com/team/hf-scale:0.1.0"
    assert main(["generate", "--preset", "ddp", image, "--targets", "ray", "--targets", "docker,ray",
                 "--output-dir", str(tmp_path)]) == 0
    assert (tmp_path / "launch" / "ddp.ray.sh").is_file() and (tmp_path / "Dockerfile").is_file()
    assert "--targets ray,docker --output-dir ." in (tmp_path / "launch" / "ddp.ray.sh").read_text()


def _config_lines(out: Path, name: str) -> list[str]:
    """The resolved config generate wrote, without its header (which names the command)."""
    return [line for line in (out / "hf_scale_configs" / f"{name}.yaml").read_text().splitlines()
            if not line.startswith("#")]


def test_planning_flags_without_strategy_auto_set_the_config_as_set_would(tmp_path, capsys):
    """--precision, --num-machines, --gpus-per-machine, --micro-batch-size and --activation-checkpointing on|off are
    config fields: without --strategy auto they apply as the --set overrides they stand for (which still win), and
    the header's command reproduces the files."""
    ip = ["--set", "topology.main_process_ip=10.1.2.3"]
    flags = ["--precision", "fp16", "--num-machines", "2", "--gpus-per-machine", "4", "--micro-batch-size", "4",
             "--activation-checkpointing", "on"]
    assert main(["generate", "--preset", "zero3", *flags, *ip, "--output-dir", str(tmp_path / "flags")]) == 0
    sets = ["precision=fp16", "topology.num_machines=2", "topology.processes_per_machine=4",
            "batch.micro_batch_size=4", "activation_checkpointing=true"]
    argv = ["generate", "--preset", "zero3", *[a for s in sets for a in ("--set", s)], *ip]
    assert main([*argv, "--output-dir", str(tmp_path / "sets")]) == 0
    assert _config_lines(tmp_path / "flags", "zero3") == _config_lines(tmp_path / "sets", "zero3")
    from hf_scale.config.distributed_config import load_config

    cfg = load_config(tmp_path / "flags" / "hf_scale_configs" / "zero3.yaml")
    assert (cfg.precision, cfg.topology.num_machines, cfg.topology.processes_per_machine,
            cfg.batch.micro_batch_size, cfg.activation_checkpointing) == ("fp16", 2, 4, 4, True)
    header = (tmp_path / "flags" / "hf_scale_configs" / "zero3.yaml").read_text().splitlines()[1]
    assert "--precision fp16" in header and "--gpus-per-machine 4" in header
    capsys.readouterr()
    command = header.removeprefix("#   hf-scale ").split()
    assert main([*command[:-1], str(tmp_path / "flags")]) == 0  # the header's own command: nothing changes
    assert "wrote" not in capsys.readouterr().out
    # --set wins over the flag, as it does over --strategy auto's plan; fp32 is the config's "no"
    assert main(["generate", "--preset", "ddp", "--precision", "fp32", "--set", "batch.micro_batch_size=2",
                 "--micro-batch-size", "8", "--output-dir", str(tmp_path / "ddp")]) == 0
    cfg = load_config(tmp_path / "ddp" / "hf_scale_configs" / "ddp.yaml")
    assert (cfg.precision, cfg.batch.micro_batch_size) == ("no", 2)


def test_the_flags_set_the_same_fields_strategy_auto_plans_them_into(tmp_path, capsys):
    """The planning flags that apply without --strategy auto (generate.PLAN_FLAG_FIELDS) set exactly the fields
    --strategy auto writes them into."""
    from paths import TINY_LLAMA

    from hf_scale.commands.generate import PLAN_FLAG_FIELDS
    from hf_scale.config.distributed_config import load_config

    flags = ["--precision", "fp16", "--num-machines", "2", "--gpus-per-machine", "2", "--micro-batch-size", "2",
             "--activation-checkpointing", "on"]
    assert main(["generate", "--strategy", "auto", "--model", str(TINY_LLAMA), *flags, "--name", "run",
                 "--output-dir", str(tmp_path / "auto")]) == 0
    planned = load_config(tmp_path / "auto" / "hf_scale_configs" / "run.yaml")
    assert planned.strategy == "ddp"
    assert main(["generate", "--preset", "ddp_multinode", *flags, "--name", "run",
                 "--output-dir", str(tmp_path / "preset")]) == 0
    applied = load_config(tmp_path / "preset" / "hf_scale_configs" / "run.yaml")
    for field in PLAN_FLAG_FIELDS.values():
        section, _, key = field.rpartition(".")
        planned_value = getattr(getattr(planned, section) if section else planned, key)
        assert planned_value == getattr(getattr(applied, section) if section else applied, key), field
