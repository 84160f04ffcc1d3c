"""Shared by the cluster-target tests: generating every target for a config."""

from __future__ import annotations

from pathlib import Path

from hf_scale.cli import main

IMAGE = "registry.example.com/team/hf-scale:0.1.0"
CONFIGS = {
    # name: (preset, --set overrides)
    "one": ("ddp", ["topology.processes_per_machine=4"]),
    "multi": ("zero3", ["topology.num_machines=4", "topology.processes_per_machine=8",
                        "topology.main_process_ip=10.0.0.1", "cluster.kubernetes.node_selector={gpu: h100}",
                        "cluster.train_args=[--max_steps, '100', --dataset, /data/a b.jsonl]"]),
    "fsdp": ("fsdp2_hybrid_multinode", ["topology.main_process_ip=node-0"]),
}


def generate_all(root: Path, name: str, targets: str = "kubeflow,pytorchjob,skypilot,ray,docker") -> Path:
    preset, sets = CONFIGS[name]
    sets = [*sets, f"cluster.image={IMAGE}"]
    args = [arg for item in sets for arg in ("--set", item)]
    assert main(["generate", "--preset", preset, *args, "--name", name, "--targets", targets,
                 "--output-dir", str(root)]) == 0
    return root
