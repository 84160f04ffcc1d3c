"""No module of hf_scale, and no benchmark script, over 500 lines: a module that grows past it is split along a
seam of its concern (CONTRIBUTING.md), not cut anywhere."""

from __future__ import annotations

from pathlib import Path

import hf_scale

MAX_LINES = 500
PACKAGE = Path(hf_scale.__file__).parent
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def over_the_limit(package: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """{module path relative to the package's parent: its line count} of every module longer than `limit`."""
    sizes = {str(file.relative_to(package.parent)): len(file.read_text().splitlines())
             for file in sorted(package.rglob("*.py"))}
    return {name: lines for name, lines in sizes.items() if lines > limit}


def test_no_module_of_hf_scale_is_over_500_lines():
    assert over_the_limit(PACKAGE) == {}


def test_no_benchmark_script_is_over_500_lines():
    assert over_the_limit(BENCHMARKS) == {}


def test_the_check_sees_every_module_at_any_depth(tmp_path):
    package = tmp_path / "pkg"
    (package / "deep" / "er").mkdir(parents=True)
    (package / "short.py").write_text("x = 1\n" * MAX_LINES)
    (package / "deep" / "er" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert over_the_limit(package) == {"pkg/deep/er/long.py": MAX_LINES + 1}
