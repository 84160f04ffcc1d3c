"""The SkyPilot task, validated by SkyPilot itself.

SkyPilot cannot be installed next to hf_scale (skypilot 0.14 pins click<8.2, huggingface-hub 2.x needs
click>=8.4.2), so CI validates against SkyPilot's own JSON schemas (sky.utils.schemas.get_task_schema,
get_resources_schema, get_storage_schema of skypilot 0.14.1, dumped into tests/data/skypilot_task_schemas.json)
with jsonschema, as sky.Task.from_yaml does; with HF_SCALE_SKYPILOT_PYTHON pointing at an interpreter that has
skypilot, sky.Task.from_yaml itself loads every generated task too."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import jsonschema
import pytest
import yaml
from cluster_helpers import CONFIGS, generate_all
from paths import TEST_DATA

from hf_scale.config import load_config
from hf_scale.exit_codes import EXIT_PREEMPTED

SCHEMAS = json.loads((TEST_DATA / "skypilot_task_schemas.json").read_text())
SKY_PYTHON = os.environ.get("HF_SCALE_SKYPILOT_PYTHON")


def validate(task: dict) -> None:
    jsonschema.validate(task, SCHEMAS["task"])
    jsonschema.validate(task["resources"], SCHEMAS["resources"])
    for mount in task.get("file_mounts", {}).values():
        if isinstance(mount, dict):
            jsonschema.validate(mount, SCHEMAS["storage"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_task_is_valid_for_skypilot(name, tmp_path):
    root = generate_all(tmp_path, name, "skypilot")
    cfg = load_config(root / "hf_scale_configs" / f"{name}.yaml")
    task = yaml.safe_load((root / "launch" / f"{name}.sky.yaml").read_text())
    validate(task)
    assert task["num_nodes"] == cfg.topology.num_machines
    assert task["resources"]["accelerators"] == f"H100:{cfg.topology.processes_per_machine}"
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == [EXIT_PREEMPTED]
    assert task["file_mounts"]["/output"] == {"name": "hf-scale-checkpoints", "mode": "MOUNT"}
    run = shlex.split(task["run"])
    assert run[:4] == ["bash", f"launch/{name}.node.sh", "--output_dir", f"/output/{name}"]
    assert run[4:] == cfg.cluster.train_args  # quoted for bash: "/data/a b.jsonl" stays one argument


def test_the_schemas_refuse_a_broken_task(tmp_path):
    task = yaml.safe_load((generate_all(tmp_path, "one", "skypilot") / "launch" / "one.sky.yaml").read_text())
    with pytest.raises(jsonschema.ValidationError):
        validate({**task, "num_node": 2})
    with pytest.raises(jsonschema.ValidationError):
        validate({**task, "resources": {**task["resources"], "use_spot": "yes"}})


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
