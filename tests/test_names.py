"""Names follow the reader (CONTRIBUTING.md): a file's path says what it is for. No two modules of hf_scale share a
file name with different meanings, and tests/ mirrors the package: a test file is named after the module or package
it tests, in the folder that mirrors where that lives."""

from __future__ import annotations

from pathlib import Path

import hf_scale

PACKAGE = Path(hf_scale.__file__).parent
TESTS = Path(__file__).parent
SUITE_WIDE = {"test_benchmarks_smoke.py", "test_cluster_helpers.py", "test_docs.py", "test_import_graph.py",
              "test_module_size.py", "test_names.py", "test_preloaded.py", "test_quiet.py"}
"""The tests of the repository and of the suite itself (its helpers, docs, import graph, sizes, names), at the top."""
CLUSTER_FOLDERS = {"slurm"}
"""tests/slurm/: jobs on a real SLURM cluster that its conftest.py starts (the generated sbatch, `doctor --slurm`)."""


def _names_in(folder: str) -> set[str]:
    """The modules and packages of hf_scale/FOLDER ('.' = the top), and the folder's own name."""
    root = PACKAGE / folder
    names = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    return names | ({Path(folder).name} if folder != "." else set())


def misnamed_tests() -> list[str]:
    found = []
    for test in sorted(TESTS.rglob("test_*.py")):
        folder = test.parent.relative_to(TESTS).as_posix()
        if (folder == "." and test.name in SUITE_WIDE) or folder in CLUSTER_FOLDERS:
            continue
        name = test.stem.removeprefix("test_")
        if not (PACKAGE / folder).is_dir() or not any(name == n or name.startswith(n + "_")
                                                       for n in _names_in(folder)):
            found.append(test.relative_to(TESTS).as_posix())
    return found


def test_every_test_file_is_named_after_a_module_of_the_folder_it_mirrors():
    """tests/X/test_Y[_Z].py tests hf_scale/X/Y.py (or the package hf_scale/X/Y/, or X as a whole)."""
    assert misnamed_tests() == []


def test_no_two_modules_share_a_name_unless_one_is_the_check_of_the_other():
    """A module named like another is only `hf-scale check`'s check of that concern (check/fp8.py checks what
    train/model/fp8.py runs), or a package's __init__/__main__."""
    by_name: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            by_name.setdefault(path.name, []).append(path.parent.relative_to(PACKAGE).as_posix())
    shared = {name: sorted(folders) for name, folders in by_name.items()
              if len(folders) > 1 and not (len(folders) == 2 and "check" in folders)}
    assert shared == {}
