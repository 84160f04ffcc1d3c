"""A refusal through the generated launch scripts ends as `python train.py` ends it: one line, printed once, exit 2
(hf_scale.exit_codes.REFUSED_MARKER_ENV), with none of the launcher's ChildFailedError traceback.

One real 2-process launch per script kind, configs written by `hf-scale generate`: a refusal of the flags on every
rank at start (accelerate launch, the deepspeed launcher), and one found after the launcher started, once the
process group is up and a rank reads the data (torchrun: the other rank then loses its peer, and its line is held
back too). The first rank's line into the marker, the others silent, is a unit test without a launcher.
"""

from __future__ import annotations

import json

import pytest
from train_helpers import child_env, free_port, training_traceback_frames

from hf_scale.commands.cli import main
from hf_scale.errors import UserError, exit_refusing
from hf_scale.exit_codes import REFUSED_MARKER_ENV
from hf_scale.train.setup.distributed import PeerLost

CPU_2PROC = ["topology.processes_per_machine=2", "deepspeed.torch_adam=true", "precision=no"]
LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "Root Cause", "=====", "exits with return code")


def test_the_first_refusing_rank_writes_the_marker_and_the_others_print_nothing(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "refused"
    monkeypatch.setenv(REFUSED_MARKER_ENV, str(marker))
    for message in ("--x=1: must be >= 2", "--x=1: must be >= 2 (another rank)"):
        with pytest.raises(SystemExit) as stopped:
            exit_refusing("train.py", UserError(message))
        assert stopped.value.code == 2
    assert marker.read_text() == "train.py: error: --x=1: must be >= 2\n"
    assert capsys.readouterr().err == ""
    # A lost peer is a failed run (exit 1), not a refusal: said here, the marker untouched.
    with pytest.raises(SystemExit) as stopped:
        exit_refusing("train.py", PeerLost("rank 1 died"))
    assert stopped.value.code == 1
    assert capsys.readouterr().err == "train.py: error: rank 1 died\n"
    monkeypatch.delenv(REFUSED_MARKER_ENV)
    with pytest.raises(SystemExit):
        exit_refusing("train.py", UserError("--y=0: must be > 0"))
    assert capsys.readouterr().err == "train.py: error: --y=0: must be > 0\n"


CASES = [
    # (id, preset, script kind, training arguments, the line)
    ("accelerate-at-start", "ddp", "accelerate", ["--bf16", "--fp16"],
     "train.py: error: --bf16 and --fp16 are both set; choose one precision"),
    ("deepspeed-at-start", "zero2", "deepspeed", ["--learning_rat", "1e-4"],
     "train.py: error: unrecognized arguments: --learning_rat 1e-4 (see python train.py --help)"),
    ("torchrun-after-launch", "zero2", "torchrun", ["--train_file", "{tmp}/d.jsonl", "--max_steps", "1"],
     "has null content"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("preset", "kind", "args", "line"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_refusal_through_each_launch_script_is_one_line_once_exit_2(preset, kind, args, line, tmp_path):
    import subprocess

    root = tmp_path / "generated"
    sets = [arg for item in CPU_2PROC for arg in ("--set", item)]
    assert main(["generate", "--preset", preset, *sets, "--name", "run", "--output-dir", str(root)]) == 0
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": None}]}
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [chat] * 8 + [bad]))
    port = str(free_port())
    env = child_env(tmp_path / "cache")
    env.pop("TRAIN_SCRIPT", None)
    env.update(MAIN_PROCESS_PORT=port, MASTER_PORT=port, TMPDIR=str(tmp_path))
    result = subprocess.run(
        ["bash", str(root / "launch" / f"run.{kind}.sh"), *[a.format(tmp=tmp_path) for a in args],
         "--output_dir", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-4000:]
    errors = [text for text in output.splitlines() if "error" in text.lower()]
    assert len(errors) == 1 and line in errors[0], output[-4000:]
    assert not [noise for noise in LAUNCHER_NOISE if noise in output], output[-4000:]
    if kind != "torchrun":  # refused at start: nothing of the launcher's own start-up lines either
        assert output.splitlines() == [line], output[-4000:]
    assert not list(tmp_path.glob("hf-scale.*")), "the script's status folder is left behind"


@pytest.mark.multiprocess
def test_a_refusal_through_the_cluster_node_script_is_one_line_once_exit_2(tmp_path):
    """launch/NAME.node.sh (the container command of the TrainJob/PyTorchJob manifests, SkyPilot's `run`) becomes
    NAME.accelerate.sh: a refusal of every rank after `accelerate launch` started them is one line, once, exit 2,
    no traceback, nothing written. Run here as SkyPilot runs one node (its SKYPILOT_* variables)."""
    import subprocess

    root = tmp_path / "generated"
    cluster = ("cluster.image=registry.example.com/hf-scale:0.1.0", "cluster.output_dir=/output")
    sets = [arg for item in (*CPU_2PROC, *cluster) for arg in ("--set", item)]
    assert main(["generate", "--preset", "ddp", *sets, "--name", "run", "--targets", "skypilot",
                 "--output-dir", str(root)]) == 0
    port = str(free_port())
    env = child_env(tmp_path / "cache")
    env.pop("TRAIN_SCRIPT", None)
    env.update(MAIN_PROCESS_PORT=port, TMPDIR=str(tmp_path), SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_RANK="0",
               SKYPILOT_NODE_IPS="127.0.0.1", SKYPILOT_NUM_GPUS_PER_NODE="2")
    out = tmp_path / "out"
    command = ["bash", str(root / "launch" / "run.node.sh"), "--bf16", "--fp16", "--output_dir", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    line = "train.py: error: --bf16 and --fp16 are both set; choose one precision"
    assert result.returncode == 2, output[-4000:]
    assert output.count(line) == 1 and [t for t in output.splitlines() if "error" in t.lower()] == [line], output
    assert not training_traceback_frames(output), output[-4000:]
    assert not [noise for noise in LAUNCHER_NOISE if noise in output], output[-4000:]
    assert not out.exists() or not any(out.iterdir())
    assert not list(tmp_path.glob("hf-scale.*")), "the script's status folder is left behind"
