"""`hf-scale check --plan PLAN.json`: a grace period, an sbatch --signal lead or a collective timeout shorter than the
planner's predicted step / save is one finding each, with the fix; the files `generate` writes from the same plan
pass."""

from __future__ import annotations

import json

import pytest
import yaml

from hf_scale.commands.cli import main
from hf_scale.planner.hardware import DATA

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256}  # fmt: skip
CODES = ("grace-period-short", "signal-lead-short", "collective-timeout-short")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A plan whose save takes ~15 minutes (a 1B model, a filesystem writing 20 MB/s), its JSON and its config."""
    tmp = tmp_path_factory.mktemp("plan")
    model, node = tmp / "llama1b.json", tmp / "slow-disk.yaml"
    model.write_text(json.dumps(LLAMA_1B))
    h100 = yaml.safe_load(DATA.read_text())["gpus"]["h100-sxm"]
    node.write_text(yaml.safe_dump({**h100, "storage_write_gbps": 0.02}))
    config, plan = tmp / "planned.yaml", tmp / "plan.json"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(model), "--gpus-per-machine", "8", "--hardware", str(node), "--json",
                     "--write-config", str(config)]) == 0  # fmt: skip
    data = json.loads(out.getvalue().split("\nwrote ")[0])
    plan.write_text(json.dumps(data))
    time = next(c for c in data["candidates"] if c["key"] == data["recommended"])["time"]
    return plan, config, time


def _generate(config, out, *sets: str):
    assert main(["generate", str(config), "--name", "run", "--targets", "kubeflow", "--output-dir", str(out), "--set",
                 "cluster.image=registry.example.com/hf-scale:0.1.0", *sets]) == 0  # fmt: skip
    manifest = next(p for p in (out / "launch").iterdir() if p.name.endswith("trainjob.yaml"))
    return manifest, out / "launch" / "run.sbatch"


def _findings(capsys, plan, manifest, sbatch, *training: str) -> list[dict]:
    capsys.readouterr()
    main(["check", "--manifest", str(manifest), "--plan", str(plan), "--sbatch", str(sbatch), "--json",
          *(["--", *training] if training else [])])  # fmt: skip
    return [f for f in json.loads(capsys.readouterr().out)["findings"] if f["code"] in CODES]


def test_budgets_shorter_than_the_predicted_step_and_save_are_one_finding_each(planned, tmp_path, capsys):
    plan, config, time = planned
    manifest, sbatch = _generate(config, tmp_path / "short", "--set", "cluster.termination_grace_period_s=600",
                                 "--set", "cluster.preempt_signal_lead_s=120")
    assert time["step_s"] + time["save_s"] > 600 and time["save_s"] > 60
    found = _findings(capsys, plan, manifest, sbatch, "--ddp_timeout", "60")
    assert sorted(f["code"] for f in found) == sorted(CODES), found
    by_code = {f["code"]: f for f in found}
    assert "terminationGracePeriodSeconds >=" in by_code["grace-period-short"]["fix"]
    assert "#SBATCH --signal=USR1@" in by_code["signal-lead-short"]["fix"]
    assert "--ddp_timeout" in by_code["collective-timeout-short"]["fix"]


def test_a_deepspeed_timeout_shorter_than_the_save_is_a_finding(planned, tmp_path, capsys):
    """DEEPSPEED_TIMEOUT (minutes) in the manifest's env, with a DeepSpeed config given: compared with the save."""
    plan, config, time = planned
    manifest, sbatch = _generate(config, tmp_path / "ds", "--set", 'cluster.env.DEEPSPEED_TIMEOUT="1"')
    assert main(["generate", "--preset", "zero2", "--output-dir", str(tmp_path / "ds")]) == 0
    capsys.readouterr()
    main(["check", "--manifest", str(manifest), "--plan", str(plan), "--json",
          str(tmp_path / "ds" / "ds_configs" / "zero2.json")])  # fmt: skip
    found = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["code"] in CODES]
    assert [(f["code"], f["key"]) for f in found] == [("collective-timeout-short", "DEEPSPEED_TIMEOUT")], found
    assert f"set DEEPSPEED_TIMEOUT={-(-2 * max(time['step_s'], time['save_s']) // 60):.0f}" in found[0]["fix"]


def test_the_files_generated_from_the_plan_pass(planned, tmp_path, capsys):
    plan, config, _ = planned
    manifest, sbatch = _generate(config, tmp_path / "planned")
    assert _findings(capsys, plan, manifest, sbatch) == []  # train.py's default --ddp_timeout, 1800 s, covers it


@pytest.mark.parametrize("flag, name, text, says", [
    ("--plan", "plan.json", '{"candidates": []}', "not the output of `hf-scale plan --json`"),
    ("--sbatch", "run.sbatch", "#!/bin/bash\n#SBATCH --signal=USR1@120\n", "only with --plan PLAN.json"),
], ids=["not-a-plan", "sbatch-without-plan"])
def test_a_bad_plan_or_sbatch_argument_is_one_line_exit_2(flag, name, text, says, tmp_path, capsys):
    given = tmp_path / name
    given.write_text(text)
    manifest = tmp_path / "job.yaml"
    manifest.write_text("kind: TrainJob\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--manifest", str(manifest), flag, str(given)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"{flag} {given}: {says}" in lines[0], lines
