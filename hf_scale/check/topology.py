"""Checks of the processes and machines: CPU runs with several processes, FSDP without GPUs, more processes
than GPUs, multi-node ranks and the main process address.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_scale.check.accelerate_yaml import launch_int
from hf_scale.check.findings import ERROR, TRAINING_ARGS, WARNING, Finding, in_file, is_int
from hf_scale.check.inputs import CheckInputs, fsdp_version_of, world_size_of
from hf_scale.files.reading import get_path


def check_use_cpu_processes(inp: CheckInputs) -> Iterator[Finding]:
    """`cpu-single-process`: `use_cpu: true` with more than one process starts ONE process (accelerate's
    simple launcher; several CPU processes need mpirun); `--use_cpu` in the training args with
    several processes trains on CPU in each of them."""
    world = world_size_of(inp)
    if world is None or world <= 1:
        return
    if inp.accelerate.get("use_cpu") is True and not get_path(
        inp.accelerate, "mpirun_config.mpirun_hostfile", None
    ):
        yield Finding(
            ERROR,
            "cpu-single-process",
            inp.accelerate_file,
            "use_cpu",
            f"use_cpu is true with num_processes={world}: `accelerate launch` then starts a single process.",
            f"{in_file(inp.accelerate_file)}set `use_cpu: false` for GPUs, or `num_processes: 1`; several CPU "
            "processes need `mpirun_config.mpirun_hostfile` (or torchrun with a gloo backend).",
            {f"{inp.accelerate_file}:use_cpu": True, f"{inp.accelerate_file}:num_processes": world},
        )
    if inp.training is None or not inp.training["use_cpu"]:
        return
    flag = "--use_cpu"
    yield Finding(
        WARNING,
        "cpu-single-process",
        TRAINING_ARGS,
        flag,
        f"{flag} with num_processes={world}: each launched process trains on the CPU, not on a GPU.",
        f"Drop {flag} from the training args to use the GPUs, or set num_processes: 1 in "
        f"{Path(inp.accelerate_file).name}.",
        {f"{TRAINING_ARGS}:{flag}": True, f"{inp.accelerate_file}:num_processes": world},
    )


def check_use_cpu_ignores_plugin(inp: CheckInputs) -> Iterator[Finding]:
    """`use-cpu-ignores-plugin`: `use_cpu: true` with FSDP or DeepSpeed: accelerate uses its simple
    launcher and silently trains without them (FSDP falls back to DDP)."""
    dtype = inp.accelerate.get("distributed_type")
    if inp.accelerate.get("use_cpu") is True and dtype in ("FSDP", "DEEPSPEED"):
        yield Finding(
            ERROR,
            "use-cpu-ignores-plugin",
            inp.accelerate_file,
            "use_cpu",
            f"use_cpu is true with distributed_type {dtype}: accelerate then ignores the {dtype} settings "
            "without an error.",
            f"{in_file(inp.accelerate_file)}set `use_cpu: false` ({dtype} through accelerate needs GPUs).",
            {f"{inp.accelerate_file}:use_cpu": True, f"{inp.accelerate_file}:distributed_type": dtype},
        )


def check_fsdp_without_gpu(inp: CheckInputs) -> Iterator[Finding]:
    """`fsdp-no-gpu`: FSDP on target machines without GPUs (`--gpus-per-machine 0`). Without it the check
    assumes nothing about the target's GPUs (the machine running the check is often a login node)."""
    if inp.accelerate.get("distributed_type") == "FSDP" and inp.gpus_per_machine == 0:
        yield Finding(
            WARNING,
            "fsdp-no-gpu",
            inp.accelerate_file,
            "distributed_type",
            "FSDP through accelerate needs GPUs and the target machines have none (--gpus-per-machine 0): it would run "
            "without sharding or gradient sync.",
            f"{in_file(inp.accelerate_file)}choose `distributed_type: MULTI_CPU` for CPU machines, or check the "
            "target's GPUs (--gpus-per-machine N).",
            {f"{inp.accelerate_file}:distributed_type": "FSDP", "--gpus-per-machine": 0},
        )


def check_fsdp_final_save(inp: CheckInputs) -> Iterator[Finding]:
    """`fsdp-sharded-final-save`: FSDP whose state dict type is not FULL_STATE_DICT (`fsdp_state_dict_type:
    SHARDED_STATE_DICT`, or FSDP2's default) under a plain HF Trainer script: its final `save_model` writes the weights
    only for FULL_STATE_DICT (transformers' Trainer.save_model), so the output directory gets no model. A hand-written
    Accelerator loop saves through accelerator.get_state_dict, which gathers; so does hf_scale's train.py in both loops
    (HfScaleTrainer.save_model), which is why train.py's flags (given after `--`) silence it."""
    section = inp.accelerate.get("fsdp_config")
    if inp.accelerate.get("distributed_type") != "FSDP" or inp.runner != "trainer" or not isinstance(section, dict):
        return
    if inp.training is not None:  # train.py's flags: train.py gathers the final model itself
        return
    effective, key = _fsdp_state_dict_type(inp, section)
    if effective in ("FULL_STATE_DICT", "1"):
        return
    file = inp.accelerate_file
    yield Finding(
        WARNING,
        "fsdp-sharded-final-save",
        file,
        f"fsdp_config.{key}",
        f"The state dict type is {effective}: a plain HF Trainer script's final save_model writes no model weights "
        "with it (transformers saves a model there only for FULL_STATE_DICT) unless the script switches the plugin "
        "to FULL_STATE_DICT before saving; the checkpoint-STEP folders hold the shards (hf_scale's train.py gathers "
        "the final model itself).",
        f"{in_file(file)}set `fsdp_config.fsdp_state_dict_type: FULL_STATE_DICT` (the final save gathers the full "
        "model on rank 0)" + (" instead of FSDP2's default (`fsdp_version: 2`)" if key == "fsdp_version" else "")
        + ", or keep it and turn the last checkpoint into a model with `hf-scale export OUTPUT_DIR/checkpoint-STEP "
        "OUT`.",
        {f"{file}:fsdp_config.{key}": section.get(key)},
    )


def _fsdp_state_dict_type(inp: CheckInputs, section: dict[str, Any]) -> tuple[str, str]:
    """(the state dict type accelerate's FSDP plugin uses, the YAML key that decides it): the variable `accelerate
    launch` exports, else the plugin's default (FULL_STATE_DICT for FSDP1, SHARDED_STATE_DICT for FSDP2)."""
    env = inp.launch_env or {}
    written = env.get("FSDP_STATE_DICT_TYPE")
    key = next((k for k in ("fsdp_state_dict_type", "state_dict_type") if k in section), None)
    if written is None and inp.launch_env is None and key is not None:
        written = str(section[key])
    if written is not None:
        return written.upper(), key or "fsdp_state_dict_type"
    return ("FULL_STATE_DICT" if fsdp_version_of(inp) == 1 else "SHARDED_STATE_DICT"), "fsdp_version"


_GPU_TYPES = ("MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM")


def check_processes_per_gpu(inp: CheckInputs) -> Iterator[Finding]:
    """`processes-exceed-gpus`: more processes per machine than `--gpus-per-machine N` GPUs per target machine (each
    process takes one GPU; the extra ones fail to start or share a GPU). Only with `--gpus-per-machine`."""
    gpus, acc = inp.gpus_per_machine, inp.accelerate
    processes, machines = acc.get("num_processes"), acc.get("num_machines", 1)
    if gpus is None or acc.get("distributed_type") not in _GPU_TYPES or acc.get("use_cpu") is True:
        return
    if not (is_int(processes) and processes > 0 and is_int(machines) and machines > 0):
        return
    if (gpus == 0 and acc.get("distributed_type") == "FSDP") or processes // machines <= gpus:
        return  # FSDP without GPUs: `fsdp-no-gpu`
    yield Finding(
        ERROR,
        "processes-exceed-gpus",
        inp.accelerate_file,
        "num_processes",
        f"num_processes={processes} over num_machines={machines} is {processes // machines} processes per "
        f"machine, but the target machines have {gpus} GPU(s) each (--gpus-per-machine {gpus}).",
        f"{in_file(inp.accelerate_file)}set `num_processes` to {gpus} x num_machines = {gpus * machines} "
        "(it is the total over all machines).",
        {f"{inp.accelerate_file}:num_processes": processes, f"{inp.accelerate_file}:num_machines": machines,
         "--gpus-per-machine": gpus},
    )


def check_process_count(inp: CheckInputs) -> Iterator[Finding]:
    """`processes-implausible`: `num_processes` (the total over all machines) or `num_machines` beyond what any
    cluster has, e.g. `num_processes: 1000000000`: per machine at most hf_scale's own bound (the
    `topology.processes_per_machine` limit of `hf-scale generate`), machines at most its `num_machines` limit.
    (--gpus-per-machine N bounds it by the target's GPUs: `processes-exceed-gpus`.)"""
    from hf_scale.config.distributed_config import MAX_MACHINES, MAX_PROCESSES_PER_MACHINE

    file, acc = inp.accelerate_file, inp.accelerate
    processes, machines = acc.get("num_processes"), acc.get("num_machines", 1)
    if not is_int(machines) or machines < 1:
        return  # `accelerate-value-invalid`
    if machines > MAX_MACHINES:
        yield Finding(
            ERROR, "processes-implausible", file, "num_machines",
            f"num_machines={machines} is more machines than any cluster has (allowed: 1..{MAX_MACHINES}).",
            f"{in_file(file)}set `num_machines` to the number of machines of the job (1..{MAX_MACHINES}).",
            {f"{file}:num_machines": machines},
        )
        return
    if not is_int(processes) or processes < 1 or processes % machines:
        return  # `accelerate-value-invalid`, `processes-not-multiple-of-machines`
    per_machine = processes // machines
    if per_machine <= MAX_PROCESSES_PER_MACHINE or inp.gpus_per_machine is not None:
        return
    yield Finding(
        ERROR,
        "processes-implausible",
        file,
        "num_processes",
        f"num_processes={processes} over num_machines={machines} is {per_machine} processes per machine: "
        f"`accelerate launch` starts them all on each machine (one per GPU), and no machine has that many "
        f"(allowed: 1..{MAX_PROCESSES_PER_MACHINE} per machine).",
        f"{in_file(file)}set `num_processes` to GPUs per machine x num_machines (the total), e.g. "
        f"{8 * machines} for {machines} machine(s) of 8 GPUs.",
        {f"{file}:num_processes": processes, f"{file}:num_machines": machines},
    )


def check_multinode(inp: CheckInputs) -> Iterator[Finding]:
    """`multinode-no-main-ip`, `processes-not-multiple-of-machines`, `machine-rank-out-of-range`: the
    multi-node topology (`machine_rank` read as `accelerate launch` reads it: int() of the value)."""
    file, acc = inp.accelerate_file, inp.accelerate
    machines = acc.get("num_machines", 1)
    if not is_int(machines) or machines <= 1:
        return
    if not acc.get("main_process_ip"):
        yield Finding(
            ERROR,
            "multinode-no-main-ip",
            file,
            "main_process_ip",
            f"num_machines={machines} but main_process_ip is not set: the machines cannot find each other.",
            f"{in_file(file)}set `main_process_ip` to the address of machine 0 (and main_process_port).",
            {f"{file}:num_machines": machines, f"{file}:main_process_ip": acc.get("main_process_ip")},
        )
    processes = acc.get("num_processes")
    if is_int(processes) and processes > 0 and processes % machines:
        yield Finding(
            ERROR,
            "processes-not-multiple-of-machines",
            file,
            "num_processes",
            f"num_processes={processes} is not a multiple of num_machines={machines} "
            "(accelerate's num_processes is the TOTAL over all machines).",
            f"{in_file(file)}set `num_processes` to processes-per-machine x {machines}, "
            f"e.g. {machines * max(1, processes // machines)}.",
            {f"{file}:num_processes": processes, f"{file}:num_machines": machines},
        )
    written = acc.get("machine_rank", 0)
    rank = launch_int(written)
    if rank is None and inp.launch_error is not None:
        return  # accelerate cannot read it at all: `accelerate-launch-fails` says so
    if rank is None or not 0 <= rank < machines:
        yield Finding(
            ERROR,
            "machine-rank-out-of-range",
            file,
            "machine_rank",
            f"machine_rank={written!r} is outside 0..{machines - 1}.",
            f"{in_file(file)}set `machine_rank` to 0 on the main machine and 1..{machines - 1} on the others.",
            {f"{file}:machine_rank": written, f"{file}:num_machines": machines},
        )


# Names and networks reserved for documentation and tests, which never reach a real machine: RFC 2606/6761
# top-level domains and example domains, RFC 5737/3849 documentation networks.
_RESERVED_TLDS = ("invalid", "example", "test", "localhost")


_RESERVED_DOMAINS = ("example.com", "example.net", "example.org")


_DOCUMENTATION_NETWORKS = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")


def address_problem(value: Any) -> tuple[str, str] | None:
    """(severity, why) when ``value`` cannot be machine 0's address in a multi-node launch: an error when it
    is no IP address nor DNS name at all, a warning for a placeholder that reaches no other machine."""
    import ipaddress

    from hf_scale.config.value_types import host_problem

    if not isinstance(value, str):
        return ERROR, f"is a {type(value).__name__}, not an address (YAML reads an unquoted 1234 as a number)"
    if "$" in value or "{" in value:
        return ERROR, "is not an address: accelerate does not expand variables in its YAML"
    if (problem := host_problem(value)) is not None:
        return ERROR, problem
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        address = None
    if address is not None:
        if address.is_unspecified or address.is_loopback:
            return WARNING, "is this machine itself: the other machines would connect to themselves"
        if any(address in ipaddress.ip_network(net) for net in _DOCUMENTATION_NETWORKS):
            return WARNING, "is a documentation address (RFC 5737/3849), a placeholder for the real one"
        return None
    name = value.rstrip(".").lower()
    if name.rsplit(".", 1)[-1] in _RESERVED_TLDS or name.endswith(_RESERVED_DOMAINS):
        return WARNING, "is a reserved placeholder name (RFC 2606/6761) that never reaches machine 0"
    return None


def check_main_process_ip(inp: CheckInputs) -> Iterator[Finding]:
    """`main-ip-invalid`, `main-ip-placeholder`: `main_process_ip` is no address at all (`'1234'`,
    `${MASTER_ADDR}`, an unquoted number), or, in a multi-node YAML, a placeholder (`main-node.invalid` as
    written by `hf-scale generate`, `*.example`, documentation networks, localhost) a launch must override."""
    file, acc = inp.accelerate_file, inp.accelerate
    machines, value = acc.get("num_machines", 1), acc.get("main_process_ip")
    if value in (None, ""):
        return
    problem = address_problem(value)
    multi_node = is_int(machines) and machines > 1
    if problem is None or (problem[0] == WARNING and not multi_node):
        return
    severity, why = problem
    yield Finding(
        severity,
        "main-ip-invalid" if severity == ERROR else "main-ip-placeholder",
        file,
        "main_process_ip",
        f"main_process_ip={value!r} {why}; "
        + (
            "`accelerate launch` cannot use it."
            if severity == ERROR
            else f"with num_machines={machines} the launch hangs or fails unless `--main_process_ip` overrides it."
        ),
        f"{in_file(file)}set `main_process_ip` to the IP address or DNS name of machine 0, or pass "
        "`--main_process_ip` to `accelerate launch` (hf_scale's launch scripts: MAIN_PROCESS_IP).",
        {f"{file}:main_process_ip": value, f"{file}:num_machines": machines},
    )
