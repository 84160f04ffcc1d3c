"""hf_scale.clusters.skypilot.skypilot_problem (what `hf-scale check --manifest` refuses in a SkyPilot task):
SkyPilot's own schemas (shipped in hf_scale/assets), applied as sky.Task.from_yaml applies them. With
HF_SCALE_SKYPILOT_PYTHON naming an interpreter that has skypilot (CI has one: .ci/run), the shipped copy is compared
with that skypilot's schemas and every verdict here with sky.Task's own."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hf_scale.clusters.skypilot import SKYPILOT_SCHEMA_VERSION, skypilot_problem, skypilot_schemas

SKY_PYTHON = os.environ.get("HF_SCALE_SKYPILOT_PYTHON")
GOOD = {"name": "mine", "num_nodes": 2, "resources": {"accelerators": "H100:4", "use_spot": True,
                                                       "job_recovery": {"strategy": "failover"}},
        "file_mounts": {"/ckpt": {"name": "my-bucket", "mode": "mount"}}, "envs": {"STEPS": 100},
        "setup": "pip install -r requirements.txt", "run": "torchrun --nproc_per_node=4 train.py"}
BAD = {
    "resorces": ({"resorces": GOOD["resources"]}, "'resorces' is not a SkyPilot field (did you mean 'resources'?)"),
    "spot-as-text": ({"resources": {**GOOD["resources"], "use_spot": "yes"}}, "resources.use_spot: 'yes'"),
    "mount-mode": ({"file_mounts": {"/ckpt": {"name": "b", "mode": "MOUNTED"}}}, "file_mounts./ckpt.mode"),
    "nodes-as-text": ({"num_nodes": "two"}, "num_nodes: 'two'"),
    "env-name": ({"envs": {"MY-VAR": "1"}}, "envs"),
}


def test_a_good_task_is_accepted():
    assert skypilot_problem(GOOD) is None  # case-insensitive enums, envs read as strings, as SkyPilot reads them


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_skypilot_refuses(case):
    change, message = BAD[case]
    task = {key: value for key, value in {**GOOD, **change}.items() if not (case == "resorces" and key == "resources")}
    problem = skypilot_problem(task)
    assert problem is not None and message in problem, problem


def _sky(code: str, *args: str) -> str:
    result = subprocess.run([SKY_PYTHON, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.skipif(not SKY_PYTHON, reason="HF_SCALE_SKYPILOT_PYTHON (an interpreter with skypilot) not set")
def test_the_shipped_schemas_are_skypilots():
    dumped = json.loads(_sky(
        "import json, sky\nfrom sky.utils import schemas\n"
        "print(json.dumps({'skypilot_version': sky.__version__, 'task': schemas.get_task_schema(), "
        "'resources': schemas.get_resources_schema(), 'storage': schemas.get_storage_schema()}))"))
    assert dumped["skypilot_version"] == SKYPILOT_SCHEMA_VERSION
    assert dumped == skypilot_schemas()


@pytest.mark.skipif(not SKY_PYTHON, reason="HF_SCALE_SKYPILOT_PYTHON (an interpreter with skypilot) not set")
def test_sky_task_agrees_with_every_verdict():
    tasks = {"good": GOOD}
    for case, (change, _) in BAD.items():
        tasks[case] = {key: value for key, value in {**GOOD, **change}.items()
                       if not (case == "resorces" and key == "resources")}
    code = ("import json, sys, sky\nfor name, task in json.loads(sys.argv[1]).items():\n"
            "    try:\n        sky.Task.from_yaml_config(task)\n        print(name, 'ok')\n"
            "    except Exception as error:\n        print(name, 'refused')\n")
    verdicts = dict(line.split() for line in _sky(code, json.dumps(tasks)).splitlines() if line.split()[:1]
                    and line.split()[0] in tasks)
    assert verdicts == {name: "ok" if name == "good" else "refused" for name in tasks}
