"""The SkyPilot task, validated by SkyPilot itself.

SkyPilot cannot be installed next to hf_scale (skypilot 0.14 pins click<8.2, huggingface-hub 2.x needs
click>=8.4.2), so every task is validated against SkyPilot's own JSON schemas as sky.Task.from_yaml applies them
(hf_scale.clusters.skypilot.skypilot_problem, which `hf-scale check` uses too; the shipped copy is compared with
skypilot's own in tests/clusters/test_skypilot_schema.py); with HF_SCALE_SKYPILOT_PYTHON pointing at an interpreter
that has skypilot (CI: .ci/run), sky.Task.from_yaml itself loads every generated task too."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
import yaml
from cluster_helpers import CONFIGS, generate_all

from hf_scale.clusters.skypilot import skypilot_problem
from hf_scale.config.distributed_config import load_config
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.generators import install

SKY_PYTHON = os.environ.get("HF_SCALE_SKYPILOT_PYTHON")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_task_is_valid_for_skypilot(name, tmp_path):
    root = generate_all(tmp_path, name, "skypilot")
    cfg = load_config(root / "hf_scale_configs" / f"{name}.yaml")
    task = yaml.safe_load((root / "launch" / f"{name}.sky.yaml").read_text())
    assert skypilot_problem(task) is None
    assert task["num_nodes"] == cfg.topology.num_machines
    assert task["resources"]["accelerators"] == f"H100:{cfg.topology.processes_per_machine}"
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == [EXIT_PREEMPTED]
    assert task["file_mounts"]["/output"] == {"name": "hf-scale-checkpoints", "mode": "MOUNT"}
    run = shlex.split(task["run"])
    assert run[:4] == ["bash", f"launch/{name}.node.sh", "--output_dir", f"/output/{name}"]
    assert run[4:] == cfg.cluster.train_args  # quoted for bash: "/data/a b.jsonl" stays one argument
    # hf_scale from the synced workdir (it is not on PyPI): the archive and pins generate wrote beside launch/.
    assert task["workdir"] == "."
    assert task["setup"] == (f"python -m pip install --requirement {install.REQUIREMENTS_FILE} "
                             f"./{install.SOURCE_ARCHIVE}")
    assert (root / install.SOURCE_ARCHIVE).is_file() and (root / install.REQUIREMENTS_FILE).is_file()
    assert "envs" not in task  # no cluster.env set


def test_cluster_env_becomes_the_tasks_envs(tmp_path):
    from hf_scale.clusters.skypilot import sky_task

    cfg = load_config(overrides=["cluster.env={NCCL_DEBUG: WARN}"])
    task = sky_task(cfg, "run")
    assert task["envs"] == {"NCCL_DEBUG": "WARN"} and skypilot_problem(task) is None


def test_the_schemas_refuse_a_broken_task(tmp_path):
    task = yaml.safe_load((generate_all(tmp_path, "one", "skypilot") / "launch" / "one.sky.yaml").read_text())
    assert "'num_node' is not a SkyPilot field" in skypilot_problem({**task, "num_node": 2})
    assert "use_spot" in skypilot_problem({**task, "resources": {**task["resources"], "use_spot": "yes"}})


@pytest.mark.skipif(not SKY_PYTHON, reason="HF_SCALE_SKYPILOT_PYTHON (an interpreter with skypilot) not set")
def test_sky_task_from_yaml_loads_every_task(tmp_path):
    paths = [generate_all(tmp_path / name, name, "skypilot") / "launch" / f"{name}.sky.yaml" for name in CONFIGS]
    code = ("import sys, sky\nfor path in sys.argv[1:]:\n    task = sky.Task.from_yaml(path)\n"
            "    print(task.num_nodes, sorted(task.storage_mounts), list(task.resources)[0].accelerators)")
    result = subprocess.run([SKY_PYTHON, "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()[-len(paths):]
    for name, line in zip(CONFIGS, lines, strict=True):
        cfg = load_config(tmp_path / name / "hf_scale_configs" / f"{name}.yaml")
        assert line == f"{cfg.topology.num_machines} ['/output'] {{'H100': {cfg.topology.processes_per_machine}}}"
