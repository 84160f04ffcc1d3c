"""`hf-scale plan --hardware FILE`: a GPU profile of the user's own node, checked strictly (one line, exit 2)."""

from __future__ import annotations

import json

import pytest
import yaml
from paths import TINY_LLAMA

from hf_scale.commands.cli import main
from hf_scale.planner.hardware import DATA, FIELDS, hardware, hardware_from_file

PROFILE = {
    "architecture": "hopper", "label": "my H100 node", "memory_gib": 80, "bf16_tflops": 700.0, "fp8_tflops": None,
    "hbm_gbps": 3000, "intra_node_gbps": 400, "inter_node_gbps": 50, "host_pcie_gbps": 50,
    "source": "measured by hf-scale doctor",
}


def write(tmp_path, **changes):
    data = {k: v for k, v in {**PROFILE, **changes}.items() if v != "DROP"}
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_file_profile_is_read_like_an_entry_of_the_data_file(tmp_path):
    hw = hardware_from_file(str(write(tmp_path)))
    assert hw.name == "node" and hw.label == "my H100 node" and hw.bf16_flops == 700e12 and hw.fp8_flops is None
    assert hw.memory_bytes == 80 * 2**30 and hw.hbm_bps == 3000e9 and hw.inter_node_bps == 50e9
    assert hw.gemm_efficiency == hardware("h100-sxm").gemm_efficiency  # the architecture's, unless set
    own = hardware_from_file(str(write(tmp_path, gemm_efficiency=0.6, cpu_memory_gbps=300)))
    assert own.gemm_efficiency == 0.6 and own.cpu_memory_bps == 300e9


def test_every_entry_of_the_data_file_is_a_valid_file_profile(tmp_path):
    gpus = yaml.safe_load(DATA.read_text())["gpus"]
    for name, entry in gpus.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(entry))
        assert hardware_from_file(str(path)) == hardware(name)
        assert set(entry) <= set(FIELDS)


def test_plan_predicts_on_the_file_profile(tmp_path, capsys):
    path = write(tmp_path)
    assert main(["plan", str(TINY_LLAMA), "--seq-len", "256", "--hardware", str(path), "--json"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert main(["plan", str(TINY_LLAMA), "--seq-len", "256", "--json"]) == 0
    sxm = json.loads(capsys.readouterr().out)
    assert mine["workload"]["gpu"] == "node"
    step = {c["key"] + str(c["activation_checkpointing"]): c["time"]["step_s"] for c in sxm["candidates"]}
    assert all(c["time"]["step_s"] > step[c["key"] + str(c["activation_checkpointing"])] for c in mine["candidates"])


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"nvlink": 3}, "unknown field 'nvlink': allowed architecture, label, memory_gib"),
    ({"hbm_gbps": "DROP"}, "missing field 'hbm_gbps' (GB/s)"),
    ({"bf16_tflops": -1}, "bf16_tflops -1 is invalid: allowed a positive number (TFLOP/s)"),
    ({"memory_gib": 0}, "memory_gib 0 is invalid: allowed a positive number (GiB)"),
    ({"inter_node_gbps": "fast"}, "inter_node_gbps 'fast' is invalid"),
    ({"host_pcie_gbps": True}, "host_pcie_gbps True is invalid"),
    ({"gemm_efficiency": 1.5}, "gemm_efficiency 1.5 is invalid: allowed a positive number (fraction of the peak"),
    ({"architecture": "volta"}, "architecture 'volta' is invalid: allowed ampere, ada, hopper, blackwell"),
    ({"label": ""}, "label '' is invalid: allowed a non-empty string"),
])  # fmt: skip
def test_a_bad_profile_is_one_line_exit_2_and_writes_nothing(changes, fragment, tmp_path, capsys):
    path, written = write(tmp_path, **changes), tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(TINY_LLAMA), "--hardware", str(path), "--write-config", str(written)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"--hardware {path}: " in lines[0] and fragment in lines[0], lines
    assert not written.exists()


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--gpu", "a10g"], "--gpu a10g and --hardware {path} are both given: choose one"),
    ([], "--hardware {missing}: not found"),
])  # fmt: skip
def test_gpu_with_hardware_is_refused_and_a_missing_file_is_one_line(flags, fragment, tmp_path, capsys):
    path, missing = write(tmp_path), tmp_path / "nothing.yaml"
    target = missing if not flags else path
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(TINY_LLAMA), *flags, "--hardware", str(target)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and fragment.format(path=path, missing=missing) in lines[0], lines
