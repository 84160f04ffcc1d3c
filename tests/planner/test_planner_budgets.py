"""The preemption budgets `generate --strategy auto` writes (hf_scale.planner.budgets): SLURM's --signal lead, the
pods' terminationGracePeriodSeconds, the SkyPilot task's Kubernetes pod grace period and Ray Train's
FailureConfig.preemption_grace_s cover the predicted step + save, never below the former fixed values. Each file is
read by its own reader: yaml + SkyPilot's schemas for the task, hf_scale.commands.ray_train's parser and Ray's
FailureConfig
for the Ray script."""

from __future__ import annotations

import json
import shlex

import yaml

from hf_scale.clusters.skypilot import skypilot_problem
from hf_scale.commands import ray_train
from hf_scale.commands.cli import main
from hf_scale.config.cluster_section import DEFAULT_GRACE_PERIOD_S, DEFAULT_SIGNAL_LEAD_S
from hf_scale.planner.budgets import HEADROOM
from hf_scale.planner.hardware import DATA

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256}  # fmt: skip


def _generate(tmp_path, model: str, capsys, *hardware: str) -> tuple[dict, str, dict, dict, float]:
    """(the plan's recommended time, the sbatch text, the TrainJob, the SkyPilot task, Ray's preemption grace) of the
    config `plan --write-config` planned for ``model`` (what `generate --strategy auto` writes: both take
    hf_scale.planner.rank.distributed_config)."""
    config = tmp_path / "planned.yaml"
    assert main(["plan", model, "--gpus-per-machine", "8", "--seq-len", "8192", "--json", *hardware,
                 "--write-config", str(config)]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out.split("\nwrote ")[0])
    time = next(c for c in plan["candidates"] if c["key"] == plan["recommended"])["time"]
    out = tmp_path / "out"
    assert main(["generate", str(config), "--name", "run", "--targets", "kubeflow,skypilot,ray", "--set",
                 "cluster.image=registry.example.com/hf-scale:0.1.0", "--output-dir", str(out)]) == 0  # fmt: skip
    sbatch = (out / "launch" / "run.sbatch").read_text()
    trainjob = next(p for p in (out / "launch").iterdir() if p.name.endswith("trainjob.yaml"))
    task = yaml.safe_load((out / "launch" / "run.sky.yaml").read_text())
    assert skypilot_problem(task) is None
    return time, sbatch, yaml.safe_load(trainjob.read_text()), task, _ray_grace(out / "launch" / "run.ray.sh")


def _ray_grace(script) -> float:
    """The preemption grace Ray Train gets from the generated script: its python -m hf_scale.commands.ray_train
    arguments read by hf_scale.commands.ray_train's own parser (with the --output_dir a user passes), turned into Ray's
    own FailureConfig."""
    command = script.read_text().split("exec python -m hf_scale.commands.ray_train ")[1].replace("\\\n", " ")
    argv = shlex.split(command.split('"$@"')[0].replace('"$generated_dir"', "DIR"))
    ns, _ = ray_train.build_parser().parse_known_args([*argv, "--output_dir", "/shared/run"])
    return ray_train.failure_config(ns).preemption_grace_s


def _sky_grace(task: dict) -> int:
    return task["config"]["kubernetes"]["pod_config"]["spec"]["terminationGracePeriodSeconds"]


def _grace(trainjob: dict) -> list[int]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            found.extend(v for k, v in node.items() if k == "terminationGracePeriodSeconds")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(trainjob)
    return found


def test_a_run_with_a_long_save_gets_a_signal_lead_and_grace_period_that_cover_its_step_and_save(tmp_path, capsys):
    """A 1B model on a node whose filesystem writes 20 MB/s (a profile file): ~18 GB of weights and AdamW states take
    ~15 minutes, beyond both floors."""
    model = tmp_path / "llama1b.json"
    model.write_text(json.dumps(LLAMA_1B))
    node = tmp_path / "slow-disk.yaml"
    h100 = yaml.safe_load(DATA.read_text())["gpus"]["h100-sxm"]
    node.write_text(yaml.safe_dump({**h100, "storage_write_gbps": 0.02}))
    time, sbatch, trainjob, task, ray_grace = _generate(tmp_path, str(model), capsys, "--hardware", str(node))
    need = time["step_s"] + time["save_s"]
    assert HEADROOM * need > DEFAULT_GRACE_PERIOD_S  # the case where the prediction, not the floor, decides
    lead = int(sbatch.split("#SBATCH --signal=USR1@")[1].split()[0])
    assert need < lead <= HEADROOM * need + 1
    assert _grace(trainjob) and all(need < g <= HEADROOM * need + 1 for g in _grace(trainjob))
    assert need < _sky_grace(task) <= HEADROOM * need + 1
    assert need < ray_grace <= HEADROOM * need + 1


def test_a_small_run_keeps_the_floors(tmp_path, capsys):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({**LLAMA_1B, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1024}))
    time, sbatch, trainjob, task, ray_grace = _generate(tmp_path, str(model), capsys)
    assert HEADROOM * (time["step_s"] + time["save_s"]) < DEFAULT_SIGNAL_LEAD_S
    assert f"#SBATCH --signal=USR1@{DEFAULT_SIGNAL_LEAD_S}\n" in sbatch
    assert _grace(trainjob) and set(_grace(trainjob)) == {DEFAULT_GRACE_PERIOD_S}
    assert _sky_grace(task) == DEFAULT_GRACE_PERIOD_S and ray_grace == DEFAULT_SIGNAL_LEAD_S
