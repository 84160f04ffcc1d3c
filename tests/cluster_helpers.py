"""Shared by the cluster-target tests: generating every target for a config, and keeping their traffic on the
loopback interface (and proving it)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import psutil

from hf_scale.clusters import CHOSEN, standard_files
from hf_scale.commands.cli import main
from hf_scale.generators.launch import launch_files

IMAGE = "registry.example.com/team/hf-scale:0.1.0"
CONFIGS = {
    # name: (preset, --set overrides)
    "one": ("ddp", ["topology.processes_per_machine=4"]),
    "multi": ("zero3", ["topology.num_machines=4", "topology.processes_per_machine=8",
                        "topology.main_process_ip=10.0.0.1", "cluster.kubernetes.node_selector={gpu: h100}",
                        "cluster.train_args=[--max_steps, '100', --train_file, /data/a b.jsonl]"]),
    "fsdp": ("fsdp2_hybrid_multinode", ["topology.main_process_ip=node-0"]),
}
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
"""gloo's interface: by default gloo takes the interface of the host name's address (this machine's network
address), so two "nodes" on one machine would talk over it; the rendezvous address alone does not keep it on lo."""


def generate_all(root: Path, name: str, targets: str = ",".join(CHOSEN)) -> Path:
    preset, sets = CONFIGS[name]
    sets = [*sets, f"cluster.image={IMAGE}"]
    args = [arg for item in sets for arg in ("--set", item)]
    assert main(["generate", "--preset", preset, *args, "--name", name, "--targets", targets,
                 "--output-dir", str(root)]) == 0
    return root


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class Connections:
    """The established TCP connections of process trees, sampled while they run: (local, remote) addresses."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def sample(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                root = psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:  # it ended meanwhile
                continue
            for process in tree:
                try:
                    connections = process.net_connections(kind="inet")
                except psutil.Error:
                    continue
                self.seen |= {(c.laddr.ip, c.raddr.ip) for c in connections
                              if c.status == psutil.CONN_ESTABLISHED and c.raddr}

    def off_loopback(self) -> list[tuple[str, str]]:
        return sorted(pair for pair in self.seen if not all(map(_loopback, pair)))


def launch_scripts(cfg, name: str, *, header: str) -> dict[str, str]:
    """File name (in launch/) -> text of every launch file generate writes without --targets: the one-machine
    scripts (hf_scale.generators.launch) and the SLURM sbatch script (hf_scale.clusters.slurm)."""
    always = {Path(path).name: text for path, text in standard_files(cfg, name, header=header).items()}
    return {**launch_files(cfg, name, header=header), **always}
