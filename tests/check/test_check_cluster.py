"""`hf-scale check --manifest`: generated TrainJob / PyTorchJob / SkyPilot files are clean against their accelerate
YAML; hand-written ones that disagree (nodes, processes, GPUs, image tag, output volume, grace period, a key the
Kubeflow API does not have) are reported with their codes; a checkpoint's measured save time sets the grace
period's floor."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml
from cluster_helpers import generate_all

from hf_scale.check.cluster import GRACE_FLOOR_S, manifest_kind, measured_save_seconds
from hf_scale.clusters import TARGETS
from hf_scale.commands.cli import main
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store

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
    """The generated manifest of every target with a manifest kind (read from the registry) passes check."""
    with_manifests = [target.name for target in TARGETS if target.manifests]
    root = generate_all(tmp_path, name, ",".join(with_manifests))
    manifests = sorted((root / "launch").glob(f"{name}.*.yaml"))
    assert len(manifests) == len(with_manifests)
    code, findings = _check(capsys, root / "accelerate_configs" / f"{name}.yaml", *manifests)
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
    store.write_manifest(saved, 5)
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


SKY_TASK = """\
name: mine
num_nodes: 2
resorces:
  accelerators: H100:4
file_mounts:
  /ckpt: {name: my-bucket, mode: MOUNT}
setup: pip install -r requirements.txt
run: |
  torchrun --nnodes=$SKYPILOT_NUM_NODES --nproc_per_node=8 \\
    --node_rank=$SKYPILOT_NODE_RANK --master_addr=$(echo "$SKYPILOT_NODE_IPS" | head -n1) \\
    train.py --output_dir /ckpt/run1
"""
ACCELERATE_2X4 = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 2
num_processes: 8
machine_rank: 0
main_process_ip: 10.0.0.1
main_process_port: 29500
mixed_precision: bf16
"""
TRAINJOB = """\
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {name: mine}
spec:
  runtimeRef: {name: torch-distributed}
  trainer:
    image: registry.example.com/me/train:1.0
    numNodes: 2
    numProcPerNode: 8
    resourcesPerNode: {limits: {nvidia.com/gpu: "8"}}
    command: [accelerate, launch, --config_file, configs/acc.yaml, train.py, --hf_scale_config, configs/hf.yaml,
              --output_dir, /scratch/out]
"""


def _run(capsys, *argv) -> tuple[int, list[dict]]:
    capsys.readouterr()
    try:
        code = main(["check", "--json", *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    return code, [f for f in json.loads(capsys.readouterr().out)["findings"] if f["code"].startswith("manifest-")]


def test_a_hand_written_skypilot_task(tmp_path, capsys):
    """A misspelled key (SkyPilot's own schema refuses it) and a run command starting 8 processes per node where the
    accelerate config runs 4 per machine."""
    task, accelerate = tmp_path / "task.yaml", tmp_path / "acc.yaml"
    task.write_text(SKY_TASK)
    accelerate.write_text(ACCELERATE_2X4)
    code, findings = _run(capsys, str(accelerate), "--manifest", str(task))
    assert code == 1 and [f["code"] for f in findings] == ["manifest-invalid", "manifest-processes"]
    assert "'resorces' is not a SkyPilot field (did you mean 'resources'?)" in findings[0]["problem"]
    assert "8 process(es) per node (the run command's torchrun --nproc_per_node)" in findings[1]["problem"]


def _hf_scale_2x4(tmp_path) -> Path:
    out = tmp_path / "generated"
    assert main(["generate", "--preset", "ddp", "--set", "topology.num_machines=2", "--set",
                 "topology.processes_per_machine=4", "--set", "topology.main_process_ip=10.0.0.1", "--name", "hf",
                 "--output-dir", str(out)]) == 0
    return out / "hf_scale_configs" / "hf.yaml"


def test_a_trainjob_against_a_given_hf_scale_config(tmp_path, capsys):
    """8 processes (and GPUs) per node against an hf_scale config of 2 machines x 4: reported without an accelerate
    YAML."""
    job = tmp_path / "job.yaml"
    job.write_text(TRAINJOB)
    code, findings = _run(capsys, str(_hf_scale_2x4(tmp_path)), "--manifest", str(job))
    found = {f["code"]: f["problem"] for f in findings}
    assert code == 1 and {"manifest-processes", "manifest-gpus"} <= set(found) and "manifest-nodes" not in found
    assert "the hf_scale config" in found["manifest-processes"]
    assert found["manifest-processes"].endswith("has 4 per machine")


@pytest.mark.parametrize("flag", ["--hf_scale_config", "--hf-scale-config"])
def test_a_trainjob_against_the_configs_its_command_names(flag, tmp_path, capsys):
    """Given only the manifest, check reads the --config_file and --hf_scale_config its command names (relative to
    the manifest here) and compares both; train.py's parser takes the flag in either spelling, and so does check."""
    job = tmp_path / "job.yaml"
    job.write_text(TRAINJOB.replace("--hf_scale_config", flag))
    (tmp_path / "configs").mkdir()
    shutil.copy(_hf_scale_2x4(tmp_path), tmp_path / "configs" / "hf.yaml")
    (tmp_path / "configs" / "acc.yaml").write_text(
        ACCELERATE_2X4.replace("num_machines: 2", "num_machines: 3").replace("num_processes: 8", "num_processes: 24"))
    code, findings = _run(capsys, "--manifest", str(job))
    by_code = {f["code"]: f["problem"] for f in findings}
    assert code == 1
    assert "configs/acc.yaml" in by_code["manifest-nodes"]  # 2 nodes, the accelerate config 3
    assert "configs/hf.yaml" in by_code["manifest-processes"]  # 8 per node, the hf_scale config 4
    assert "configs/hf.yaml" in by_code["manifest-gpus"]


@pytest.mark.parametrize("broken", [{"trainer": "oops"}, {"trainer": {"numNodes": 2}, "runtimePatches": ["x"]}])
def test_a_trainjob_of_the_wrong_shape_is_one_finding(broken, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                                   "metadata": {"name": "x"}, "spec": {"runtimeRef": {"name": "r"}, **broken}}))
    code, findings = _run(capsys, "--manifest", str(job))
    assert code == 1 and [f["code"] for f in findings][:1] == ["manifest-invalid"]


@pytest.mark.parametrize("manifest", ["one.trainjob.yaml", "one.sky.yaml"])
@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        # train.py's parser keeps the last --output_dir: the checkpoints land off the volume, and the micro batch
        # contradicts the config train.py gets from NAME.node.sh.
        (["--output_dir", "/elsewhere", "--per_device_train_batch_size", "4"],
         "batch.micro_batch_size=1 but --per_device_train_batch_size=4"),
        (["--output_dir=/elsewhere", "--bogus"], "unrecognized arguments: --bogus"),
        (["--output-dir", "/elsewhere", "--learning_rate", "fast"], "invalid float value: 'fast'"),
    ],
    ids=["contradiction", "unknown-flag", "bad-value"],
)
def test_the_arguments_a_manifest_hands_train_py_are_read_as_train_py_reads_them(manifest, extra, problem, tmp_path,
                                                                                   capsys):
    """A second --output_dir wins in train.py (argparse keeps the last), so it is the one that must be on the volume;
    a flag train.py refuses, or one contradicting the hf_scale config the node script passes, fails the job at start
    on the cluster: both are reported before it queues."""
    root = generate_all(tmp_path, "one", "kubeflow,skypilot")
    path = root / "launch" / manifest
    data = yaml.safe_load(path.read_text())
    if manifest.endswith(".sky.yaml"):
        data["run"] += " " + " ".join(extra)
    else:
        data["spec"]["trainer"]["args"] += extra
    path.write_text(yaml.safe_dump(data))
    code, findings = _run(capsys, "--manifest", str(path))
    by_code = {f["code"]: f["problem"] for f in findings}
    assert code == 1 and sorted(by_code) == ["manifest-output-volume", "manifest-train-args"], findings
    assert problem in by_code["manifest-train-args"]
    assert "--output_dir '/elsewhere'" in by_code["manifest-output-volume"]


def test_train_py_arguments_with_values_the_job_decides_are_not_parsed(tmp_path, capsys):
    """$VARs the manifest's env does not define are the job's: nothing certain to parse (one of the manifest's own
    is read)."""
    job = tmp_path / "job.yaml"
    job.write_text(TRAINJOB.replace("/scratch/out]", "/scratch/out, --max_steps, $STEPS, --seed, $SEED]")
                   + '    env: [{name: STEPS, value: "100"}]\n')
    code, findings = _run(capsys, "--manifest", str(job))
    assert "manifest-train-args" not in {f["code"] for f in findings}
    job.write_text(TRAINJOB.replace("/scratch/out]", "/scratch/out, --max_steps, $STEPS]")
                   + '    env: [{name: STEPS, value: "many"}]\n')
    code, findings = _run(capsys, "--manifest", str(job))
    assert [f["problem"] for f in findings if f["code"] == "manifest-train-args"][0].count("'many'") == 1


def test_an_accelerate_num_processes_is_split_by_the_machines_of_the_yaml_it_launches(tmp_path, capsys):
    """`accelerate launch --config_file zero3.yaml --num_processes 4` starts 4 processes (the flag overrides the
    YAML's 8), 4 per machine of its 1: against the 8 GPUs and the hf_scale config's 8 per machine."""
    root = generate_all(tmp_path, "multi", "kubeflow")  # 4 machines x 8 processes
    job = root / "launch" / "job.yaml"
    command = ["accelerate", "launch", "--config_file", "accelerate_configs/multi.yaml", "--num_processes", "16",
               "train.py", "--output_dir", "/output/multi"]
    data = yaml.safe_load(TRAINJOB.replace("numNodes: 2", "numNodes: 4"))
    data["spec"]["trainer"]["command"] = command
    job.write_text(yaml.safe_dump(data))
    code, findings = _run(capsys, "--manifest", str(job))
    found = {f["code"]: f["problem"] for f in findings}
    assert code == 1 and "manifest-processes" in found, findings
    assert ("starts 4 process(es) per node (the command's accelerate launch --num_processes 16 over num_machines=4 "
            "of ") in found["manifest-processes"]
    data["spec"]["trainer"]["command"] = [*command[:5], "32", *command[6:]]  # 32 over 4 machines: 8 each
    job.write_text(yaml.safe_dump(data))
    assert "manifest-processes" not in {f["code"] for f in _run(capsys, "--manifest", str(job))[1]}


@pytest.mark.parametrize(("train_batch_size", "expected"), [(16, []), (8, ["manifest-deepspeed-batch"])])
def test_a_deepspeed_batch_counts_the_processes_accelerate_launch_num_processes_starts(train_batch_size, expected,
                                                                                         tmp_path, capsys):
    """`accelerate launch --config_file acc.yaml --num_processes 16` on 2 nodes starts 8 per node, a world of 16
    (the YAML's own num_processes is 8, the TrainJob's numProcPerNode 4): DeepSpeed's train_batch_size is checked
    against 16, the world the flag starts."""
    job = tmp_path / "job.yaml"
    job.write_text(TRAINJOB.replace("configs/acc.yaml,", "configs/acc.yaml, --num_processes, '16',")
                   .replace(" --hf_scale_config, configs/hf.yaml,", "")
                   .replace("numProcPerNode: 8", "numProcPerNode: 4"))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "acc.yaml").write_text(ACCELERATE_2X4)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": train_batch_size, "train_micro_batch_size_per_gpu": 1,
                              "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}))
    code, findings = _run(capsys, str(ds), "--manifest", str(job))
    found = [f for f in findings if f["code"] == "manifest-deepspeed-batch"]
    assert [f["code"] for f in found] == expected, found
    if expected:
        assert code == 1 and "16 processes" in found[0]["problem"]


def _trainjob(**changes) -> dict:
    data = yaml.safe_load(TRAINJOB)
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return data


def _pytorchjob(worker_replicas) -> dict:
    data = yaml.safe_load(PYTORCHJOB)
    data["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = worker_replicas
    return data


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (_trainjob(spec=None), "spec.runtimeRef is missing"),
        (_trainjob(apiVersion="kubeflow.org/v2"), "apiVersion 'kubeflow.org/v2' is not one the TrainJob API serves"),
        (_trainjob(metadata={"name": "Bad_Name"}), "metadata.name 'Bad_Name' is not an RFC 1035 label"),
        (_trainjob(metadata={"name": "a" * 64}), "is not an RFC 1035 label"),
        (_trainjob(metadata={"namespace": "x"}), "metadata.name is missing"),
        (_pytorchjob(-1), "spec.pytorchReplicaSpecs.Worker.replicas=-1: must be at least 1"),
        (_pytorchjob(0), "spec.pytorchReplicaSpecs.Worker.replicas=0"),
        ({**yaml.safe_load(PYTORCHJOB), "apiVersion": "kubeflow.org/v1beta2"}, "allowed: kubeflow.org/v1"),
    ],
    ids=["trainjob-no-spec", "unknown-version", "name-underscore", "name-too-long", "no-name", "worker-minus-one",
         "worker-zero", "pytorchjob-version"],
)
def test_what_kubernetes_refuses_and_kubeflows_models_cannot_tell(data, problem, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    code, findings = _run(capsys, "--manifest", str(job))
    assert code == 1 and findings[0]["code"] == "manifest-invalid" and problem in findings[0]["problem"], findings
