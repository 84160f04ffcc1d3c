"""The runtime guard fires on each known silent fallback — each one built for real in 2 processes."""

from __future__ import annotations

import json
import re

import pytest
from train_helpers import REPO, child_env, launcher_command, run, torchrun, training_traceback_frames

pytestmark = pytest.mark.multiprocess


def _guard_problems(mode: str, tmp_path) -> list[list[str]]:
    result = run(torchrun(REPO / "tests" / "_guard_worker.py", mode, tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text())["problems"] for r in (0, 1)]


@pytest.mark.parametrize(
    ("mode", "expected_fragment"),
    [
        ("no_gloo", "DistributedType.NO"),
        ("fsdp_on_cpu", "FSDP was requested but the model is not sharded"),
        ("zero_stage_mismatch", "ZeRO stage 3 was requested but the engine runs stage 2"),
        ("accumulation_mismatch", "DeepSpeed gradient_accumulation_steps=4"),
        ("precision_mismatch", "DeepSpeed runs precision bf16 but the flags ask for no"),
        ("zero3_loaded_full", "the model was built unpartitioned"),
    ],
)
def test_guard_fires_on_silent_fallback(mode, expected_fragment, tmp_path):
    for rank_problems in _guard_problems(mode, tmp_path):
        assert any(expected_fragment in p for p in rank_problems), rank_problems


def test_guard_passes_real_ddp(tmp_path):
    assert _guard_problems("ddp_ok", tmp_path) == [[], []]


def _accelerate_yaml(path, **fields) -> None:
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": 1,
        "num_processes": 2,
        "rdzv_backend": "static",
        "same_network": True,
        "mixed_precision": "no",
    }
    config.update(fields)
    import yaml

    path.write_text(yaml.safe_dump(config))


def test_train_refuses_accelerate_cpu_launch_that_starts_one_process(tmp_path):
    # `use_cpu: true` + num_processes 2: accelerate's simple launcher starts ONE process, no error.
    config = tmp_path / "cpu2.yaml"
    _accelerate_yaml(config, distributed_type="MULTI_CPU", use_cpu=True)
    result = run(
        launcher_command("accelerate", config=config)
        + ["--max_steps", "1", "--output_dir", str(tmp_path / "out")],
        env=child_env(),
    )
    # accelerate's launcher turns train.py's exit 2 into its own exit 1 (with its own traceback).
    assert result.returncode != 0
    assert "train.py: error: runtime guard: accelerate started ONE process" in result.stderr, result.stderr[
        -3000:
    ]
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize(("version", "sync_module_states"), [(2, None), (1, True)])
def test_train_refuses_fsdp_that_accelerate_cannot_run_on_cpu(tmp_path, version, sync_module_states):
    # FSDP1 with fsdp_sync_module_states: accelerate's plugin would die in its own traceback ("no available
    # devices") on every rank first; the guard speaks before it.
    config = tmp_path / "fsdp.yaml"
    _accelerate_yaml(
        config,
        distributed_type="FSDP",
        use_cpu=False,
        fsdp_config={"fsdp_version": version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                     **({"fsdp_sync_module_states": True} if sync_module_states else {})},
    )
    result = run(
        launcher_command("accelerate", config=config)
        + ["--max_steps", "1", "--loop", "accelerate", "--output_dir", str(tmp_path / "out")],
        env=child_env(),
    )
    # Each rank prints the one line and exits 2; torch's elastic agent (accelerate launch runs it for FSDP) reports
    # any failed rank as its own exit 1, with its ChildFailedError summary naming the ranks' exit code (docs/train.md).
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*2 ", result.stderr), result.stderr[-3000:]
    assert "runtime guard: " in result.stderr and "FSDP was requested" in result.stderr, result.stderr[-3000:]
    assert training_traceback_frames(result.stderr) == [], result.stderr[-3000:]
    assert not (tmp_path / "out").exists()
