"""`hf-scale check --manifest`: generated TrainJob / PyTorchJob / SkyPilot files are clean against their accelerate
YAML; hand-written ones that disagree (nodes, processes, GPUs, image tag, output volume, grace period, a key the
Kubeflow API does not have) are reported with their codes; a checkpoint's measured save time sets the grace
period's floor."""

from __future__ import annotations

import json
import os
import time

import pytest
import yaml
from cluster_helpers import generate_all

from hf_scale.check.cluster import GRACE_FLOOR_S, manifest_kind, measured_save_seconds
from hf_scale.cli import main
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store as checkpoint

PYTORCHJOB = """\
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: mine}
spec:
  nprocPerNode: "4"
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
      template:
        spec:
          containers:
          - name: pytorch
            image: my/image:latest
            command: [accelerate, launch, --config_file, multi.yaml, train.py, --output_dir, /scratch/out]
            resources: {limits: {nvidia.com/gpu: 4}}
    Worker:
      replicas: 1
      restartPolicy: OnFailure
      template:
        spec:
          containers:
          - name: pytorch
            image: my/image:latest
            command: [accelerate, launch, --config_file, multi.yaml, train.py, --output_dir, /scratch/out]
            resources: {limits: {nvidia.com/gpu: 4}}
"""


def _check(capsys, yaml_path, *manifests, extra=()) -> tuple[int, list[dict]]:
    capsys.readouterr()  # what `hf-scale generate` printed
    argv = ["check", "--accelerate-config", str(yaml_path), "--json", *extra]
    for manifest in manifests:
        argv += ["--manifest", str(manifest)]
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    report = json.loads(capsys.readouterr().out)
    # The accelerate/DeepSpeed findings (e.g. a relative deepspeed_config_file) are other tests' business.
    return code, [(f["code"], f["severity"]) for f in report["findings"] if f["code"].startswith("manifest-")]


@pytest.mark.parametrize("name", ["one", "multi"])
def test_generated_manifests_are_clean(name, tmp_path, capsys):
    root = generate_all(tmp_path, name, "kubeflow,pytorchjob,skypilot")
    code, findings = _check(capsys, root / "accelerate_configs" / f"{name}.yaml",
                            *(root / "launch" / f"{name}.{kind}.yaml" for kind in ("trainjob", "pytorchjob", "sky")))
    assert findings == []


def test_a_hand_written_pytorchjob_against_its_accelerate_yaml(tmp_path, capsys):
    root = generate_all(tmp_path, "multi", "kubeflow")  # 4 machines x 8 processes
    job = tmp_path / "mine.yaml"
    job.write_text(PYTORCHJOB)
    code, findings = _check(capsys, root / "accelerate_configs" / "multi.yaml", job)
    assert code == 1
    assert findings == [("manifest-nodes", "error"), ("manifest-processes", "error"), ("manifest-gpus", "error"),
                        ("manifest-image", "error"), ("manifest-output-volume", "error"),
                        ("manifest-grace-period", "warning")]


def test_trainjob_problems(tmp_path, capsys):
    root = generate_all(tmp_path, "one", "kubeflow")
    data = yaml.safe_load((root / "launch" / "one.trainjob.yaml").read_text())
    data["spec"]["trainer"]["numProcPerNod"] = 4  # misspelled: Kubeflow's model drops it
    pod = data["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod["template"]["spec"]["template"]["spec"]["volumes"] = [{"name": "output", "emptyDir": {}}]  # not persistent
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, findings = _check(capsys, root / "accelerate_configs" / "one.yaml", bad)
    assert code == 1 and findings == [("manifest-invalid", "error"), ("manifest-output-volume", "error")]


def test_a_skypilot_copy_mount_is_not_an_output_volume(tmp_path, capsys):
    root = generate_all(tmp_path, "one", "skypilot")
    data = yaml.safe_load((root / "launch" / "one.sky.yaml").read_text())
    data["file_mounts"]["/output"]["mode"] = "COPY"  # read-only on the nodes
    data["resources"]["accelerators"] = "H100:8"
    bad = tmp_path / "task.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, findings = _check(capsys, root / "accelerate_configs" / "one.yaml", bad)
    assert code == 1 and findings == [("manifest-gpus", "error"), ("manifest-output-volume", "error")]


def test_the_grace_period_against_a_measured_save(tmp_path, capsys):
    root = generate_all(tmp_path, "one", "kubeflow")  # grace period 600 s
    saved = tmp_path / "out" / "checkpoint-5"
    saved.mkdir(parents=True)
    (saved / "model.safetensors").write_bytes(b"x" * 10)
    checkpoint.write_manifest(saved, 5)
    start = time.time()
    os.utime(saved / "model.safetensors", (start - 400, start - 400))  # a save that took 400 s
    assert measured_save_seconds(saved) == pytest.approx(400, abs=5)
    code, findings = _check(capsys, root / "accelerate_configs" / "one.yaml", root / "launch" / "one.trainjob.yaml",
                            extra=["--checkpoint", str(saved)])
    assert code == 1 and findings == [("manifest-grace-period", "error")]  # 600 s < 2 x 400 s
    assert GRACE_FLOOR_S < 600


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
         [("manifest-deepspeed-batch", "error")]),  # 2 x 1 x 8 = 16, not 64
        ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
         [("manifest-deepspeed-batch", "error")]),  # 12 does not divide over 8 processes
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, []),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, []),
    ],
    ids=["product-off", "indivisible", "equal", "auto"],
)
def test_a_deepspeed_json_batch_against_the_world_size_the_manifest_starts(batch, expected, tmp_path, capsys):
    """A PyTorchJob of 2 nodes x 4 processes is a world of 8: DeepSpeed asserts its train_batch_size against it at
    start, on the cluster; check says so before the job queues (a hand-written job and a DeepSpeed JSON alone)."""
    job = tmp_path / "mine.yaml"
    job.write_text(PYTORCHJOB)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**batch, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    capsys.readouterr()
    try:
        code = main(["check", str(ds), str(job), "--json"])
    except SystemExit as exit_info:
        code = exit_info.code
    report = json.loads(capsys.readouterr().out)
    found = [f for f in report["findings"] if f["code"] == "manifest-deepspeed-batch"]
    assert [(f["code"], f["severity"]) for f in found] == expected
    if expected:
        assert code == 1 and "8 processes" in found[0]["problem"]


def test_unrecognized_files_are_bad_input(tmp_path):
    with pytest.raises(UserError, match="neither a TrainJob"):
        manifest_kind({"kind": "Deployment"})
    assert manifest_kind({"run": "python x.py"}) == "SkyPilot"
