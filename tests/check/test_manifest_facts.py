"""hf_scale.check.manifest_facts: the processes and nodes a job's command gives its launcher, and the config files
it names, found on this machine."""

from __future__ import annotations

import pytest
import yaml
from cluster_helpers import generate_all

from hf_scale.check.manifest_facts import (
    FROM_PLATFORM,
    launcher_counts,
    manifest_facts,
    named_files,
    output_dir,
    train_command,
)
from hf_scale.clusters import MANIFEST_KINDS

KINDS = {kind.kind: kind for kind in MANIFEST_KINDS}

SKY_RUN = """\
cd ~/sky_workdir
torchrun --nnodes=$SKYPILOT_NUM_NODES --nproc_per_node=8 \\
  --node_rank=$SKYPILOT_NODE_RANK --master_addr=$(echo "$SKYPILOT_NODE_IPS" | head -n1) \\
  train.py --output_dir /ckpt/run1  # the training
"""


@pytest.mark.parametrize(
    ("command", "env", "want"),
    [
        ("torchrun --nproc_per_node 8 train.py", {}, (8, None)),
        ("torchrun --nproc-per-node=4 --nnodes 2 train.py", {}, (4, 2)),
        ("python -m torch.distributed.run --nproc_per_node=$NPROC train.py", {"NPROC": "2"}, (2, None)),
        ("torchrun --nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE train.py", {}, (FROM_PLATFORM, None)),
        ("torchrun --nproc_per_node gpu train.py", {}, (FROM_PLATFORM, None)),
        ("torchrun --nproc_per_node=$UNKNOWN train.py", {}, (None, None)),
        ("/usr/bin/accelerate launch --num_processes 16 --num_machines 2 train.py", {}, (8, 2)),
        ("accelerate launch --config_file a.yaml --num_processes 16 train.py", {}, (None, None)),  # split: the YAML's
        ("deepspeed --num_gpus=4 --num_nodes 2 train.py", {}, (4, 2)),
        ("python train.py --deepspeed ds.json", {}, (None, None)),  # no launcher: one process
    ],
)
def test_launcher_counts(command, env, want):
    procs, nodes, _ = launcher_counts(command.split(), env)
    assert (procs, nodes) == want


def test_a_skypilot_run_script_is_read_as_bash_reads_it():
    task = {"num_nodes": 2, "resources": {"accelerators": {"H100": 4}}, "run": SKY_RUN,
            "file_mounts": {"/ckpt": {"name": "b", "mode": "MOUNT"}}}
    facts = manifest_facts(KINDS["SkyPilot"], task)
    assert (facts.nodes, facts.procs, facts.gpus, facts.mounts) == (2, 8, 4, ["/ckpt"])
    assert "the run command's torchrun" in facts.procs_where
    assert facts.args[facts.args.index("--output_dir") + 1] == "/ckpt/run1"


def test_a_container_command_overrides_the_operators_count():
    job = {"spec": {"nprocPerNode": "4", "pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {
        "containers": [{"name": "pytorch", "image": "x:1", "command": ["bash", "-c"],
                        "args": ["torchrun --nproc_per_node=$N train.py"], "env": [{"name": "N", "value": "2"}]}]}}}}}}
    facts = manifest_facts(KINDS["PyTorchJob"], job)
    assert facts.procs == 2 and "container command" in facts.procs_where
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"] = ["python train.py"]
    assert manifest_facts(KINDS["PyTorchJob"], job).procs == 4  # no launcher count: the operator's nprocPerNode


def test_generated_manifests_name_their_hf_scale_config(tmp_path):
    """The image's path (/opt/hf-scale/run/launch/NAME.node.sh) and SkyPilot's workdir-relative one both lead to
    the generated directory the manifest lies in."""
    root = generate_all(tmp_path, "one", "kubeflow,skypilot")
    for manifest, kind in (("one.trainjob.yaml", "TrainJob"), ("one.sky.yaml", "SkyPilot")):
        data = yaml.safe_load((root / "launch" / manifest).read_text())
        found = named_files(manifest_facts(KINDS[kind], data), root / "launch" / manifest)
        assert found["hf_scale"][1] == root / "hf_scale_configs" / "one.yaml"


def test_named_files_that_do_not_exist_here_are_left_out(tmp_path):
    facts = manifest_facts(KINDS["SkyPilot"], {"run": "accelerate launch --config_file nowhere.yaml train.py "
                                                      "--hf_scale_config /nowhere/x.yaml"})
    assert named_files(facts, tmp_path / "task.yaml") == {}


@pytest.mark.parametrize(
    ("run", "args", "output"),
    [
        ("torchrun --nproc_per_node 8 train.py --output_dir /a --output_dir /b", ["--output_dir", "/a", "--output_dir",
                                                                                  "/b"], "/b"),
        ("python -m hf_scale.train --output-dir=/a --seed 1; echo --output_dir /c", ["--output-dir=/a", "--seed", "1"],
         "/a"),
        ("bash launch/x.node.sh --output_dir $OUT && sync", ["--output_dir", "/env"], "/env"),
        ("bash my_script.sh --output_dir /a --output_dir /b", None, "/b"),  # no train.py: the command's last
    ],
)
def test_train_py_arguments_and_the_output_dir_train_py_reads(run, args, output):
    facts = manifest_facts(KINDS["SkyPilot"], {"run": run, "envs": {"OUT": "/env"}})
    command = train_command(facts)
    assert (command.args if command else None) == args
    assert output_dir(facts) == output
