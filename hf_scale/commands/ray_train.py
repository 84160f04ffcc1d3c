"""`python -m hf_scale.commands.ray_train --hf_scale_config CONFIG.yaml [options] [train.py flags]`: train.py on a Ray
cluster.

Ray Train's ``TorchTrainer`` starts one worker per process of the config (``ScalingConfig``: workers = world size,
one GPU each when the cluster has GPUs), gives them a process group and runs train.py's own ``train`` function in
each (``hf_scale.train.main.train``: the same flags, checks, loops and checkpoints as under torchrun). The run's
checkpoints live in ``--output_dir`` (a filesystem every Ray node sees), which is also the ``RunConfig`` storage.
``FailureConfig(max_failures=N)``: when a worker dies (a lost node, a killed process) Ray restarts the whole group
and train.py resumes from the newest complete checkpoint there (``--resume_from_checkpoint auto`` is added unless
the flags already say where to resume from). ``--preemption_grace_s N`` is ``FailureConfig(preemption_grace_s=N)``:
how long the workers of a preempted group may keep running past the node's drain deadline (the generated
``launch/NAME.ray.sh`` passes cluster.preempt_signal_lead_s, a predicted step + save); the drain window itself is the
cloud's or the autoscaler's, which no Ray Train setting lengthens.

Ray is an optional dependency (``pip install 'hf-scale[ray]'``). Without RAY_ADDRESS or --ray_address a local Ray
instance is started; --ray_node_ip pins the address that Ray (and so the workers' rendezvous, Ray's MASTER_ADDR) use.
A loopback address (127.0.0.1, localhost) keeps a one-machine run on the loopback interface: Ray itself would replace
it with the machine's network address (a node other machines can reach), so hf_scale turns Ray's cluster mode off for
that instance (LOCAL_ONLY_ENV). Gloo picks its own interface: set GLOO_SOCKET_IFNAME=lo too.

Everything that can be decided before Ray starts is (one line, exit 2): train.py's flags read as train.py reads them
(a refusal in a worker would be retried by Ray, max_failures times), this module's own values, and for a new local
instance the workers it can place (:func:`local_placement`: Ray would otherwise wait for them forever).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import urllib.parse
from pathlib import Path

from hf_scale.config.distributed_config import DistributedConfig, load_config
from hf_scale.errors import UserError, exit_with_user_error
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.knowledge import rules
from hf_scale.knowledge.precision_rules import fp8_machine_refusal

PROG = "python -m hf_scale.commands.ray_train"
DEFAULT_MAX_FAILURES = 3
CONNECT_TIMEOUT_S = 15.0
"""How long an existing cluster's head may take to accept a connection before the address is refused (ray.init
itself waits for it forever)."""
GCS_PORT = 6379
RAY_CLIENT_PORT = 10001
"""Ray's default ports of a head's GCS (ray start --head --port) and of its Ray Client server."""
_EMPTY = {
    "--ray_address": "give the cluster's address (HOST:PORT, ray://HOST:PORT, auto) or leave the flag out to start "
    "a new local Ray instance",
    "--output_dir": "give the run's directory, on storage every Ray node sees",
}
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for cluster mode (read when ray is imported; its name is historical: off is how Ray runs on laptops).
Off, the node's address is 127.0.0.1 for the raylet, every worker and Ray Train's MASTER_ADDR; on (Linux's default),
ray.init(_node_ip_address="127.0.0.1") is turned into the machine's network address."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,  # an abbreviation is train.py's to refuse (--output would otherwise be --output_dir)
        description="Run train.py with Ray Train's TorchTrainer: one worker per process of --hf_scale_config. "
        "Every other flag goes to train.py.",
        epilog="example:\n  python -m hf_scale.commands.ray_train --hf_scale_config hf_scale_configs/zero2.yaml "
        "--output_dir /shared/run1 --max_steps 1000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hf_scale_config", required=True, metavar="CONFIG.yaml",
                        help="the DistributedConfig (hf_scale_configs/NAME.yaml from `hf-scale generate`)")
    parser.add_argument("--output_dir", required=True, metavar="DIR",
                        help="train.py's output directory, on storage every Ray node sees; also the RunConfig "
                        "storage_path")
    parser.add_argument("--max_failures", type=int, default=DEFAULT_MAX_FAILURES, metavar="N",
                        help=f"restarts of the worker group after a worker failure (default {DEFAULT_MAX_FAILURES}; "
                        "-1: unlimited)")
    parser.add_argument("--preemption_grace_s", type=float, default=0.0, metavar="S",
                        help="seconds a preempted worker group may keep running past the drain deadline to finish its "
                        "step and checkpoint (Ray Train's FailureConfig.preemption_grace_s; default 0: Ray's)")
    parser.add_argument("--ray_address", metavar="ADDRESS",
                        help="Ray cluster to join (default: $RAY_ADDRESS, else a new local instance)")
    parser.add_argument("--ray_node_ip", metavar="IP",
                        help="a new local instance's node address, an IPv4/IPv6 address or localhost (Ray's "
                        "MASTER_ADDR for the workers), e.g. 127.0.0.1")
    parser.add_argument("--ray_num_cpus", type=int, metavar="N",
                        help="CPUs a new local instance offers, 1 or more (default: all of this machine's); without "
                        "GPUs each worker takes one, so N may exceed the cores to run more workers than cores")
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, DistributedConfig, list[str]]:
    """This module's options, the loaded config and train.py's arguments (everything else, plus the config,
    the output directory and --resume_from_checkpoint auto unless given), each checked before Ray starts: train.py's
    arguments as train.py reads them (hf_scale.check.train_flags), so that a flag it refuses is one line here, not a
    worker failure that Ray retries."""
    from hf_scale.check.train_flags import against_config, parse_train_flags
    from hf_scale.train.prepare import check_flags_alone

    parser = build_parser()
    parser.error = _one_line_error  # type: ignore[method-assign]
    ns, train_args = parser.parse_known_args(argv)
    if ns.max_failures < -1:
        raise UserError(f"--max_failures={ns.max_failures} is invalid: allowed -1 (unlimited) or 0 and more")
    if not 0 <= ns.preemption_grace_s < float("inf"):  # argparse's float takes nan and inf
        raise UserError(f"--preemption_grace_s={ns.preemption_grace_s} is invalid: allowed 0 or more seconds")
    if ns.ray_num_cpus is not None and ns.ray_num_cpus < 1:
        raise UserError(f"--ray_num_cpus={ns.ray_num_cpus} is invalid: allowed 1 or more (leave it out to offer all "
                        "of this machine's CPUs)")
    ns.ray_node_ip = _node_ip(ns.ray_node_ip)
    for flag, value in (("--ray_address", ns.ray_address), ("--output_dir", ns.output_dir)):
        if value is not None and not value.strip():  # `--ray_address=$HEAD` with HEAD unset, `--output_dir ''`
            raise UserError(f"{flag}={value!r} is empty (an unset variable?): {_EMPTY[flag]}")
    # The cluster to join, decided once: "local" (Ray's own word for a new local instance) when none is named.
    ns.ray_address = ns.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    local_only = [flag for flag, value in (("--ray_node_ip", ns.ray_node_ip), ("--ray_num_cpus", ns.ray_num_cpus))
                  if value is not None]
    if ns.ray_address != "local" and local_only:
        raise UserError(f"{local_only[0]} sets up a new local Ray instance, but --ray_address/RAY_ADDRESS="
                        f"{ns.ray_address} joins an existing cluster (its own addresses and CPUs count): drop one of "
                        "them")
    cfg = load_config(ns.hf_scale_config)
    if cfg.world_size < 1:  # pragma: no cover - the config's own validation guarantees it
        raise UserError("the config's world size must be at least 1")
    output_dir = str(Path(ns.output_dir).resolve())
    # Ray restarts the workers after a failure and every start resumes `auto`: a job that restarts itself, which
    # runs what resumes at its sp (the manual loop under sequence parallelism), as the generated scripts do.
    train_args = ["--hf_scale_config", str(Path(ns.hf_scale_config).resolve()), "--output_dir", output_dir,
                  *rules.restart_loop_flags(cfg.layout.sp), *train_args]
    try:
        flags = parse_train_flags(train_args)
        check_flags_alone(flags.namespace)  # train.py's own refusals before its process group, one source
    except UserError as error:
        raise UserError(f"train.py's arguments: {error}") from None
    problem = rules.restart_loop_problem(cfg.layout.sp, flags.namespace.loop)  # --loop trainer given, or a recipe's
    if problem:
        raise UserError(f"train.py's arguments: {problem}")
    if "resume_from_checkpoint" not in flags.given:  # in any spelling train.py takes, or from its recipe
        train_args += ["--resume_from_checkpoint", "auto"]
    contradictions = against_config(flags, cfg, f"--hf_scale_config={ns.hf_scale_config}").contradictions
    if contradictions:
        raise UserError("; ".join(contradictions))
    ns.output_dir = output_dir
    return ns, cfg, train_args


def reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse (UserError) an existing cluster's address where nothing answers within ``timeout_s``: ray.init would
    wait for it forever. ``local`` and ``auto`` (the address this machine's running Ray wrote down) are Ray's to find;
    ``ray://HOST[:PORT]`` is Ray Client (port 10001 by default), anything else a head's GCS HOST[:PORT] (6379)."""
    if address in ("local", "auto"):
        return
    scheme, _, rest = address.rpartition("://")
    if scheme not in ("", "ray"):
        return  # another scheme names its own way of connecting (a Ray provider's plugin): nothing to probe
    default_port = RAY_CLIENT_PORT if scheme == "ray" else GCS_PORT
    try:
        parts = urllib.parse.urlsplit(f"//{rest}")
        host, port = parts.hostname, parts.port or default_port
    except ValueError:
        host = port = None
    if not host or parts.path or parts.query:
        raise UserError(f"--ray_address/RAY_ADDRESS={address!r} is invalid: allowed local, auto, HOST:PORT (the head's "
                        f"GCS, port {GCS_PORT} by default) or ray://HOST:PORT (Ray Client, port {RAY_CLIENT_PORT})")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        reason = "no answer" if isinstance(error, TimeoutError) else (error.strerror or str(error))
        raise UserError(f"--ray_address/RAY_ADDRESS={address}: nothing answers at {host}:{port} within {timeout_s:g} s "
                        f"({reason}): start the cluster's head there (ray start --head) or give its address") from None


def _ray_client_missing(address: str) -> str | None:
    """Why ``ray://`` cannot be used here (None when it can): Ray Client needs ray[client]'s packages (grpc)."""
    if not address.startswith("ray://"):
        return None
    from ray._private.utils import get_ray_client_dependency_error  # Ray's own test, the one ray.init applies

    if get_ray_client_dependency_error() is None:
        return None
    return (f"--ray_address/RAY_ADDRESS={address} connects through Ray Client, which needs pip install "
            "'ray[client]' (grpcio) here; or run this command on the cluster's head with --ray_address auto")


def _node_ip(value: str | None) -> str | None:
    """--ray_node_ip as an address Ray can bind (localhost is 127.0.0.1)."""
    if value is None or value == "localhost":
        return None if value is None else "127.0.0.1"
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise UserError(f"--ray_node_ip={value!r} is invalid: allowed an IPv4 or IPv6 address (e.g. 127.0.0.1) or "
                        "localhost") from None


def local_placement(cfg: DistributedConfig, *, gpus: int, cpus: int, cpus_given: bool) -> None:
    """Refuse what a new local Ray instance cannot place: Ray would wait for resources that never come (retrying
    forever), so this is decided before it starts. ``gpus``: this machine's (one worker each); ``cpus``: what the
    instance offers (--ray_num_cpus, else Ray's count of this machine's)."""
    world = cfg.world_size
    if gpus:
        if gpus < world:
            raise UserError(f"the config's world_size={world} needs {world} GPUs (one per worker); this machine has "
                            f"{gpus}: lower topology.processes_per_machine, or join a cluster with --ray_address")
        return
    if cfg.precision == "fp8":
        raise UserError(fp8_machine_refusal(cfg.fp8.backend, capability=None, importable=True))
    if world > cpus:
        offered = f"--ray_num_cpus {cpus}" if cpus_given else f"this machine's {cpus} CPU(s)"
        raise UserError(f"the config's world_size={world} needs {world} CPU workers (one CPU each: this machine has no "
                        f"GPU) but the new local Ray instance offers {offered}: give --ray_num_cpus {world} (more "
                        "workers than cores), lower topology.processes_per_machine, or join a cluster with "
                        "--ray_address")


def _one_line_error(message: str) -> None:
    raise UserError(message)


def _train_worker(loop_config: dict) -> None:
    """One Ray worker: train.py's own train function in this process (Ray set RANK/WORLD_SIZE/LOCAL_RANK and
    MASTER_ADDR/MASTER_PORT and created the process group)."""
    from hf_scale import quiet

    argv = list(loop_config["argv"])
    if not quiet.verbose_requested(argv):  # what train.py's entry point does before the libraries load
        quiet.quiet_training()
    from hf_scale.train.main import train

    code = train(argv)
    if code == EXIT_PREEMPTED:
        # A stop request (SIGTERM/SIGUSR1) saved a checkpoint: a failure for Ray, which restarts the group.
        raise RuntimeError("hf_scale: stopped after saving a checkpoint (exit 75); resuming on the next attempt")
    if code:
        raise RuntimeError(f"hf_scale: train.py ended with exit code {code}")


def failure_config(ns: argparse.Namespace):
    """Ray Train's ``FailureConfig`` of these options: the restart budget and the preemption grace. A Ray whose
    FailureConfig has no ``preemption_grace_s`` (it came with Ray Train v2's preemption handling) runs without it,
    said on stderr."""
    import dataclasses

    from ray.train import FailureConfig

    grace = {"preemption_grace_s": ns.preemption_grace_s} if ns.preemption_grace_s else {}
    if grace and "preemption_grace_s" not in {f.name for f in dataclasses.fields(FailureConfig)}:
        print(f"{PROG}: warning: --preemption_grace_s={ns.preemption_grace_s:g} is ignored: this Ray's FailureConfig "
              "has no preemption_grace_s (a newer Ray has)", file=sys.stderr)
        grace = {}
    return FailureConfig(max_failures=ns.max_failures, **grace)


def scaling(cfg: DistributedConfig, cluster_gpus: float) -> dict:
    """ScalingConfig arguments for the config: one worker per process, one GPU each when the cluster has GPUs."""
    use_gpu = cluster_gpus > 0
    if use_gpu and cluster_gpus < cfg.world_size:
        raise UserError(
            f"the config's world_size={cfg.world_size} needs {cfg.world_size} GPUs (one per worker); the Ray "
            f"cluster has {cluster_gpus:g}"
        )
    return {"num_workers": cfg.world_size, "use_gpu": use_gpu,
            "resources_per_worker": {"GPU": 1} if use_gpu else {"CPU": 1}}


def local_only_env(address: str, node_ip: str | None) -> dict[str, str]:
    """What the environment needs before ray is imported: cluster mode off for a new local instance on loopback."""
    if address != "local" or node_ip is None:
        return {}
    try:
        loopback = node_ip == "localhost" or ipaddress.ip_address(node_ip).is_loopback
    except ValueError:  # a host name: Ray resolves it
        loopback = False
    return {LOCAL_ONLY_ENV: "0"} if loopback else {}


def run(argv: list[str]) -> int:
    ns, cfg, train_args = parse(argv)
    address = ns.ray_address
    os.environ.update(local_only_env(address, ns.ray_node_ip))  # before `import ray`, which reads it
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise UserError("Ray is not installed: pip install 'hf-scale[ray]'") from None
    problem = _ray_client_missing(address)
    if problem:
        raise UserError(problem)
    reachable(address)

    if address == "local":
        import torch
        from ray._private.utils import get_num_cpus  # what ray.init offers by default (cgroup limits included)

        local_placement(cfg, gpus=torch.cuda.device_count(), cpus=ns.ray_num_cpus or get_num_cpus(),
                        cpus_given=ns.ray_num_cpus is not None)
    init: dict = {"address": address, "include_dashboard": False, "log_to_driver": True}
    if address == "local":
        if ns.ray_node_ip:
            init["_node_ip_address"] = ns.ray_node_ip
        if ns.ray_num_cpus:
            init["num_cpus"] = ns.ray_num_cpus
    try:
        ray.init(**init)
    except (ConnectionError, ValueError) as error:  # an address that answered but is no Ray head, a refused value
        raise UserError(f"--ray_address/RAY_ADDRESS={address}: Ray could not start or join it: {error}") from None
    try:
        scaling_args = scaling(cfg, ray.cluster_resources().get("GPU", 0))
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config={"argv": train_args},
            # gloo without GPUs, NCCL with them: what train.py itself picks under torchrun.
            torch_config=TorchConfig(backend="nccl" if scaling_args["use_gpu"] else "gloo"),
            scaling_config=ScalingConfig(**scaling_args),
            run_config=RunConfig(
                name="ray_train",
                storage_path=ns.output_dir,
                failure_config=failure_config(ns),
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    if result.error is not None:
        print(f"{PROG}: error: {result.error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    from hf_scale import quiet

    if not quiet.verbose_requested(argv):  # train.py's parser loads the libraries here too: their known noise
        quiet.quiet_training(replica=False)
    try:
        code = run(argv)
    except UserError as error:
        exit_with_user_error(PROG, error)
    sys.exit(code)


if __name__ == "__main__":
    main()
