"""The tests' fork server (tests/preloaded.py) ends a train.py run as a fresh interpreter does: the same steps, the
same exit code and the same one-line refusal."""

from __future__ import annotations

import subprocess
from pathlib import Path

import preloaded
from train_helpers import LAUNCH_TIMEOUT_S, REPO, TRAIN_PY, child_env, launcher_command, read_metrics


def _both(argv: list[str], out: Path) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """`python train.py ARGV --output_dir OUT/fresh` as a subprocess, and `... OUT/forked` from the fork server."""
    command = launcher_command("python") + argv + ["--output_dir"]
    fresh = subprocess.run([*command, str(out / "fresh")], cwd=REPO, env=child_env(), capture_output=True, text=True,
                           timeout=LAUNCH_TIMEOUT_S)
    forked = preloaded.run([*command, str(out / "forked")], cwd=REPO, env=child_env(), timeout=LAUNCH_TIMEOUT_S,
                           train_py=TRAIN_PY, server_env=child_env())
    assert forked is not None, "the run did not start from the fork server"
    return fresh, forked


def test_a_preloaded_run_trains_the_same_steps_as_a_fresh_interpreter(tmp_path):
    fresh, forked = _both(["--max_steps", "2", "--loop", "accelerate", "--seed", "3"], tmp_path)
    assert fresh.returncode == forked.returncode == 0, (fresh.stderr[-2000:], forked.stderr[-2000:])
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    runs = [read_metrics(tmp_path / name) for name in ("fresh", "forked")]
    assert [[r[k] for k in keys] for r in runs[0]] == [[r[k] for k in keys] for r in runs[1]]


def test_a_preloaded_refusal_is_the_same_line_and_exit_code(tmp_path):
    fresh, forked = _both(["--bf16", "--fp16"], tmp_path)
    lines = [[line for line in r.stderr.splitlines() if line.startswith("train.py: error:")] for r in (fresh, forked)]
    assert fresh.returncode == forked.returncode == 2 and len(lines[0]) == 1 and lines[0] == lines[1], lines


def test_the_server_has_imported_the_runtime_before_it_forks():
    context = preloaded.server_context(child_env())
    process = context.Process(target=preloaded.preload_state)
    process.start()
    process.join(LAUNCH_TIMEOUT_S)
    assert process.exitcode == 0, "the fork server did not import tests/preloaded_runtime.py: every run imports again"
