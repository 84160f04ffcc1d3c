"""The preemption budgets `generate --strategy auto` writes (hf_scale.planner.budgets): SLURM's --signal lead and the
pods' terminationGracePeriodSeconds cover the predicted step + save, never below the former fixed values."""

from __future__ import annotations

import json

import yaml

from hf_scale.commands.cli import main
from hf_scale.config.cluster_section import DEFAULT_GRACE_PERIOD_S, DEFAULT_SIGNAL_LEAD_S
from hf_scale.planner.budgets import HEADROOM
from hf_scale.planner.hardware import DATA

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256}  # fmt: skip


def _generate(tmp_path, model: str, capsys, *hardware: str) -> tuple[dict, str, dict]:
    """(the plan's recommended time, the sbatch text, the TrainJob) of the config `plan --write-config` planned for
    ``model`` (what `generate --strategy auto` writes: both take hf_scale.planner.rank.distributed_config)."""
    config = tmp_path / "planned.yaml"
    assert main(["plan", model, "--gpus-per-machine", "8", "--seq-len", "8192", "--json", *hardware,
                 "--write-config", str(config)]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out.split("\nwrote ")[0])
    time = next(c for c in plan["candidates"] if c["key"] == plan["recommended"])["time"]
    out = tmp_path / "out"
    assert main(["generate", str(config), "--name", "run", "--targets", "kubeflow", "--set",
                 "cluster.image=registry.example.com/hf-scale:0.1.0", "--output-dir", str(out)]) == 0  # fmt: skip
    sbatch = (out / "launch" / "run.sbatch").read_text()
    trainjob = next(p for p in (out / "launch").iterdir() if p.name.endswith("trainjob.yaml"))
    return time, sbatch, yaml.safe_load(trainjob.read_text())


def _grace(trainjob: dict) -> list[int]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            found.extend(v for k, v in node.items() if k == "terminationGracePeriodSeconds")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(trainjob)
    return found


def test_a_run_with_a_long_save_gets_a_signal_lead_and_grace_period_that_cover_its_step_and_save(tmp_path, capsys):
    """A 1B model on a node whose filesystem writes 20 MB/s (a profile file): ~18 GB of weights and AdamW states take
    ~15 minutes, beyond both floors."""
    model = tmp_path / "llama1b.json"
    model.write_text(json.dumps(LLAMA_1B))
    node = tmp_path / "slow-disk.yaml"
    h100 = yaml.safe_load(DATA.read_text())["gpus"]["h100-sxm"]
    node.write_text(yaml.safe_dump({**h100, "storage_write_gbps": 0.02}))
    time, sbatch, trainjob = _generate(tmp_path, str(model), capsys, "--hardware", str(node))
    need = time["step_s"] + time["save_s"]
    assert HEADROOM * need > DEFAULT_GRACE_PERIOD_S  # the case where the prediction, not the floor, decides
    lead = int(sbatch.split("#SBATCH --signal=USR1@")[1].split()[0])
    assert need < lead <= HEADROOM * need + 1
    assert _grace(trainjob) and all(need < g <= HEADROOM * need + 1 for g in _grace(trainjob))


def test_a_small_run_keeps_the_floors(tmp_path, capsys):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({**LLAMA_1B, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1024}))
    time, sbatch, trainjob = _generate(tmp_path, str(model), capsys)
    assert HEADROOM * (time["step_s"] + time["save_s"]) < DEFAULT_SIGNAL_LEAD_S
    assert f"#SBATCH --signal=USR1@{DEFAULT_SIGNAL_LEAD_S}\n" in sbatch
    assert _grace(trainjob) and set(_grace(trainjob)) == {DEFAULT_GRACE_PERIOD_S}
