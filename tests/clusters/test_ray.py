"""hf_scale.clusters.ray: launch/NAME.ray.sh, the Ray Train driver script (its real run on a local Ray cluster is
tests/commands/test_ray_train.py's; shellcheck reads it in tests/generators/test_node_entry.py)."""

from __future__ import annotations

import shlex
import subprocess

from hf_scale.clusters.ray import ray_script
from hf_scale.config.presets import load_preset


def test_the_driver_runs_ray_train_with_the_config_and_its_restart_budget(tmp_path):
    cfg = load_preset("zero3", ["topology.num_machines=2", "topology.main_process_ip=10.0.0.1",
                                                 "cluster.max_restarts=5"])
    script = tmp_path / "run.ray.sh"
    script.write_text(ray_script(cfg, "run", header="h"))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    command = script.read_text().split("\nexec ", 1)[1].replace("\\\n", " ")
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "hf_scale.commands.ray_train"]
    assert words[words.index("--hf_scale_config") + 1] == "$generated_dir/hf_scale_configs/run.yaml"
    assert words[words.index("--max_failures") + 1] == "5"
    assert words[-1] == "$@"
    assert f"Ray Train: {cfg.world_size} workers" in script.read_text()
