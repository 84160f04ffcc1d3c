"""How an image or a cloud node gets hf_scale: from the generated directory itself, never from a package index.

hf_scale is not on PyPI (a name anyone could register there), so `hf-scale generate` packs the hf_scale that
generated the files into the output directory: ``hf-scale-source.tar.gz``, a source archive of the installed
package (its modules and assets, with a pyproject.toml whose dependencies are the installed distribution's),
which ``pip install`` builds like any sdist. Its dependencies are pinned to the versions this hf_scale runs with
(``hf-scale-requirements.txt``). The Dockerfile copies both into the image and the SkyPilot task's ``setup``
installs them from its synced workdir: every node runs exactly the hf_scale whose checks the configs passed.

The archive is reproducible (sorted entries, fixed times and owners, no gzip timestamp): generating again with
the same hf_scale writes the same bytes, so `hf-scale generate` leaves it unchanged.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from importlib import metadata
from pathlib import Path

import hf_scale
from hf_scale import __version__
from hf_scale.errors import UserError
from hf_scale.generators.output_paths import REQUIREMENTS_FILE, SOURCE_ARCHIVE

DISTRIBUTION = "hf-scale"
PINNED = ("transformers", "accelerate", "deepspeed", "datasets", "peft", "pydantic", "pyyaml", "safetensors", "tqdm")
"""hf_scale's dependencies besides torch (which the CUDA base image provides), pinned."""
ARCHIVE_TIME = 1_577_836_800
"""Every archive entry's mtime (2020-01-01): fixed for reproducibility, after 1980 for the wheel built from it."""


def requirements() -> str:
    """The pins: each dependency at the version installed with this hf_scale (what its tests ran with)."""
    lines = [f"{name}=={metadata.version(name)}" for name in PINNED]
    return (
        "# hf_scale's dependencies at the versions it was generated with (written by hf-scale generate).\n"
        + "\n".join(lines) + "\n"
    )


def pip_install(*, constraint: str | None = None) -> str:
    """The pip command that installs the pins and the packed hf_scale in one resolution (a conflict fails it)."""
    constrained = f"--constraint {constraint} " if constraint else ""
    return f"python -m pip install {constrained}--requirement {REQUIREMENTS_FILE} ./{SOURCE_ARCHIVE}"


def _dependencies() -> list[str]:
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise UserError(f"--targets docker/skypilot pack the installed hf_scale, but no {DISTRIBUTION} distribution "
                        "is installed: pip install hf_scale's source (pip install -e .) and generate again") from None
    return sorted(req for req in requires if "extra ==" not in req)  # the core dependencies, not the extras


def _requires_python() -> str:
    """The Python floor of the installed hf_scale (its pyproject's requires-python), so the packed copy keeps it."""
    return metadata.metadata(DISTRIBUTION).get("Requires-Python") or ""


def _pyproject(dependencies: list[str]) -> str:
    listed = "".join(f"    {json.dumps(dep)},\n" for dep in dependencies)  # a JSON string is a TOML string
    return f"""# Written by hf-scale generate: the hf_scale {__version__} that generated this directory.
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{DISTRIBUTION}"
version = "{__version__}"
requires-python = "{_requires_python()}"
dependencies = [
{listed}]

[project.scripts]
hf-scale = "hf_scale.commands.cli:main"

[tool.setuptools.packages.find]
include = ["hf_scale*"]

[tool.setuptools.package-data]
hf_scale = ["assets/**/*"]
"""


def _package_files() -> list[Path]:
    """What a wheel of hf_scale holds: its modules and its assets (no caches, nothing else lying in the folder)."""
    root = Path(hf_scale.__file__).parent
    files = [path for path in root.rglob("*") if path.is_file() and "__pycache__" not in path.parts
             and (path.suffix == ".py" or path.relative_to(root).parts[0] == "assets")]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def source_archive() -> bytes:
    """``hf-scale-source.tar.gz``: the installed hf_scale as a source archive pip installs (see the docstring)."""
    top = f"hf_scale-{__version__}"
    root = Path(hf_scale.__file__).parent
    entries = [(f"{top}/pyproject.toml", _pyproject(_dependencies()).encode())]
    entries += [(f"{top}/hf_scale/{path.relative_to(root).as_posix()}", path.read_bytes()) for path in _package_files()]
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), ARCHIVE_TIME, 0o644
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
