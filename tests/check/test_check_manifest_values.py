"""`hf-scale check --manifest` on what users bring that is not hf_scale's own: a job that runs a training of its own,
a TrainJob whose runtime supplies the image, the node counts each engine sets, values Kubernetes / the Training
Operator / SkyPilot refuse that Kubeflow's models let through, `.inf` anywhere, plain-text tokens, several YAML
documents in one file. (The public files among them are in tests/data/peer_configs,
tests/check/test_checks_peer_configs.py.)
"""

from __future__ import annotations

import json

import pytest
import yaml
from check_cases import run_cli

from hf_scale.check.manifest_facts import manifest_facts
from hf_scale.clusters import MANIFEST_KINDS, PLATFORM_VARIABLES

KINDS = {kind.kind: kind for kind in MANIFEST_KINDS}

PYTORCHJOB = """\
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: mine, namespace: team-a}
spec:
  nprocPerNode: "4"
  runPolicy: {backoffLimit: 3}
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
      template:
        spec:
          terminationGracePeriodSeconds: 300
          containers:
          - name: pytorch
            image: my/image:1.0
            command: [python, -m, hf_scale.train, --hf_scale_config, /cfg/run.yaml, --output_dir, /out/run]
            ports: [{containerPort: 29500, name: pytorchjob-port}]
            resources: {limits: {nvidia.com/gpu: 4}}
            volumeMounts: [{name: out, mountPath: /out}]
          volumes: [{name: out, persistentVolumeClaim: {claimName: out}}]
"""
TRAINJOB = """\
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {name: mine}
spec:
  runtimeRef: {name: torch-distributed}
  trainer:
    numNodes: 2
    command: [python, -m, hf_scale.train, --output_dir, /out/run]
"""
SKY_TASK = """\
num_nodes: 2
resources: {accelerators: H100:8}
run: accelerate launch --num_machines $SKYPILOT_NUM_NODES -m hf_scale.train --output_dir /out/run
"""


def _findings(tmp_path, capsys, text: str, *files: str) -> tuple[int, list[dict]]:
    job = tmp_path / "job.yaml"
    job.write_text(text)
    code, out, err = run_cli(["check", "--json", *files, "--manifest", str(job)], capsys)
    assert code in (0, 1), err
    return code, json.loads(out)["findings"]


def _edited(text: str, path: str, value) -> str:
    data = yaml.safe_load(text)
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(last) if last.isdigit() else last] = value
    return yaml.safe_dump(data)


CONTAINER = "spec.pytorchReplicaSpecs.Master.template.spec.containers.0"


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        ("spec.nprocPerNode", "abc", "spec.nprocPerNode='abc': torchrun refuses it"),
        ("spec.nprocPerNode", "-3", "spec.nprocPerNode='-3'"),
        ("spec.pytorchReplicaSpecs.Master.restartPolicy", "Sometimes", "restartPolicy='Sometimes' is not one"),
        ("spec.runPolicy.backoffLimit", -5, "spec.runPolicy.backoffLimit=-5 is not allowed"),
        (f"{CONTAINER}.ports.0.containerPort", 70000, "containerPort=70000 is not allowed (allowed: 1-65535)"),
        ("metadata.namespace", "a b", "metadata.namespace 'a b' is not an RFC 1123 label"),
    ],
    ids=["nproc-word", "nproc-negative", "restart-sometimes", "backoff-negative", "port-too-high", "namespace-space"],
)
def test_what_the_engine_refuses_is_manifest_invalid(path, value, problem, tmp_path, capsys):
    code, findings = _findings(tmp_path, capsys, _edited(PYTORCHJOB, path, value))
    assert code == 1 and [f["code"] for f in findings] == ["manifest-invalid"], findings
    assert problem in findings[0]["problem"], findings


def test_the_valid_pytorchjob_is_clean_and_elastic_metrics_are_read(tmp_path, capsys):
    """The Training Operator SDK names a model for elasticPolicy.metrics that it does not ship (an AttributeError)."""
    assert _findings(tmp_path, capsys, PYTORCHJOB) == (0, [])
    metrics = [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                                             "averageUtilization": 80}}}]
    elastic = _edited(PYTORCHJOB, "spec.elasticPolicy", {"minReplicas": 1, "maxReplicas": 2, "metrics": metrics})
    assert _findings(tmp_path, capsys, elastic) == (0, [])


@pytest.mark.parametrize("policy", ["Never", "ExitCode"])
def test_a_restart_policy_that_makes_the_preemption_exit_final(policy, tmp_path, capsys):
    code, findings = _findings(tmp_path, capsys, _edited(PYTORCHJOB, "spec.pytorchReplicaSpecs.Master.restartPolicy",
                                                         policy))
    assert code == 1 and [f["code"] for f in findings] == ["manifest-restart-policy"], findings
    assert "exits 75" in findings[0]["problem"]


INFINITE = [
    (PYTORCHJOB, "spec.pytorchReplicaSpecs.Master.replicas"),
    (PYTORCHJOB, "spec.runPolicy.backoffLimit"),
    (PYTORCHJOB, f"{CONTAINER}.ports.0.containerPort"),
    (PYTORCHJOB, "spec.pytorchReplicaSpecs.Master.template.spec.terminationGracePeriodSeconds"),
    (TRAINJOB, "spec.trainer.numNodes"),
    (SKY_TASK, "num_nodes"),
]


@pytest.mark.parametrize(("text", "path"), INFINITE, ids=[path.rsplit(".", 1)[-1] for _, path in INFINITE])
def test_an_infinite_number_is_one_line_exit_2(text, path, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(_edited(text, path, "INF").replace("INF", ".inf"))
    code, out, err = run_cli(["check", "--manifest", str(job)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{path.replace('.0.', '[0].')}=.inf is not a finite number" in err


@pytest.mark.parametrize("key", ["num_processes", "num_machines", "machine_rank", "deepspeed_config.gradient_clipping"])
def test_an_infinite_number_in_an_accelerate_yaml_is_one_line_exit_2(key, tmp_path, capsys):
    values = {"distributed_type": "MULTI_GPU", "num_processes": 2, "num_machines": 1}
    *section, name = key.split(".")
    (values.setdefault(section[0], {}) if section else values)[name] = "INF"
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(values).replace("INF", ".inf"))
    code, out, err = run_cli(["check", str(tmp_path / "acc.yaml")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{key}=.inf is not a finite number" in err, err


def test_an_infinite_accelerator_count_is_refused(tmp_path, capsys):
    code, findings = _findings(tmp_path, capsys, SKY_TASK.replace("H100:8", "H100:1e400"))
    assert code == 1 and findings[0]["code"] == "manifest-invalid", findings
    assert "count '1e400' of 'H100:1e400' is not a finite positive number" in findings[0]["problem"]


def test_a_plain_text_token_is_a_warning_a_reference_is_not(tmp_path, capsys):
    plain = _edited(PYTORCHJOB, f"{CONTAINER}.env", [{"name": "HF_TOKEN", "value": "hf_abc"}])
    code, findings = _findings(tmp_path, capsys, plain)
    assert code == 0 and [(f["code"], f["key"]) for f in findings] == [("manifest-secret", "env.HF_TOKEN")], findings
    referenced = _edited(PYTORCHJOB, f"{CONTAINER}.env", [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}])
    assert _findings(tmp_path, capsys, referenced) == (0, [])
    sky = SKY_TASK + "envs: {HF_TOKEN: hf_abc}\n"
    assert [f["code"] for f in _findings(tmp_path, capsys, sky)[1]] == ["manifest-secret", "manifest-output-volume"]


def test_a_trainjob_without_an_image_takes_the_runtimes(tmp_path, capsys):
    """spec.trainer.image is optional (the runtime supplies it): a warning that hf_scale must be in it, no error."""
    volume = _edited(TRAINJOB, "spec.runtimePatches", [{"manager": "me", "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {
            "terminationGracePeriodSeconds": 300,
            "containers": [{"name": "node", "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
            "volumes": [{"name": "out", "persistentVolumeClaim": {"claimName": "out"}}]}}}}}]}}}}])
    code, findings = _findings(tmp_path, capsys, volume)
    assert [(f["severity"], f["code"]) for f in findings] == [("warning", "manifest-image")], findings
    assert code == 0 and "runtime 'torch-distributed' supplies the image" in findings[0]["problem"]


def test_a_job_running_no_hf_scale_is_said_once_and_compared_for_what_applies(tmp_path, capsys):
    other = _edited(TRAINJOB, "spec.trainer.command", ["python3", "-c", "print('hello')"])
    code, findings = _findings(tmp_path, capsys, other)
    assert code == 0 and [f["code"] for f in findings] == ["manifest-not-hf-scale"], findings


def test_the_engines_node_count_variables_are_the_manifests_own_count(tmp_path, capsys):
    """`accelerate launch --num_machines $SKYPILOT_NUM_NODES` overrides the YAML's num_machines with the task's."""
    (tmp_path / "acc.yaml").write_text("distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 8\n")
    volume = SKY_TASK + "file_mounts: {/out: {name: bucket, mode: MOUNT}}\n"
    assert _findings(tmp_path, capsys, volume, str(tmp_path / "acc.yaml")) == (0, [])
    for variable, (engine, counts) in PLATFORM_VARIABLES.items():
        flag = "--nnodes" if counts == "nodes" else "--nproc_per_node"
        facts = manifest_facts(KINDS["SkyPilot"], {"run": f"torchrun {flag} ${variable} train.py",
                                                   "num_nodes": 2})
        assert engine and facts.launcher_nodes is None and facts.procs is None, variable


def test_several_documents_are_read_for_the_jobs_among_them(tmp_path, capsys):
    runtime = "apiVersion: trainer.kubeflow.org/v1alpha1\nkind: TrainingRuntime\nmetadata: {name: rt}\nspec: {}\n"
    code, findings = _findings(tmp_path, capsys, f"---\n{runtime}---\n{PYTORCHJOB}")
    assert code == 0 and [(f["code"], f["key"]) for f in findings] == [("manifest-not-read", "document 1")], findings
    assert "is TrainingRuntime: check does not read it" in findings[0]["problem"]
    job = tmp_path / "two.yaml"
    job.write_text(f"---\n{runtime}---\n{PYTORCHJOB}")
    code, out, _ = run_cli(["check", "--json", str(job)], capsys)  # recognized positionally too
    assert code == 0 and [f["code"] for f in json.loads(out)["findings"]] == ["manifest-not-read"]
    pipeline = "name: pipeline\n---\n" + SKY_TASK + "file_mounts: {/out: {name: bucket, mode: MOUNT}}\n"  # SkyPilot's
    code, findings = _findings(tmp_path, capsys, pipeline)
    assert code == 0 and [(f["code"], f["key"]) for f in findings] == [("manifest-not-read", "document 1")], findings


@pytest.mark.parametrize("args", ["--model_id $MODEL --output_dir /out/run", "--output_dir $OUT"])
def test_a_train_py_with_job_values_and_no_hf_scale_mark_is_not_taken_for_hf_scale(tmp_path, capsys, args):
    """`python train.py $VAR...` of no hf_scale mark (-m hf_scale.train, a node script, --hf_scale_config) cannot be
    parsed here: said once as not hf_scale's, not compared as if it were (no output volume or grace period)."""
    task = SKY_TASK.replace("-m hf_scale.train --output_dir /out/run", f"train.py {args}")
    code, findings = _findings(tmp_path, capsys, task)
    assert code == 0 and [f["code"] for f in findings] == ["manifest-not-hf-scale"], findings
    assert "$" in findings[0]["problem"], findings
    marked = SKY_TASK.replace("-m hf_scale.train --output_dir /out/run", f"train.py --hf_scale_config c.yaml {args}")
    assert "manifest-not-hf-scale" not in [f["code"] for f in _findings(tmp_path, capsys, marked)[1]]
