"""The documentation's links resolve, the README stays short, and its test command is the one CI runs.

Plain Markdown that GitHub renders, no site builder: so the check GitHub would do when a reader clicks is done
here. Every relative link and `#anchor` in README.md, CONTRIBUTING.md, benchmarks/README.md and docs/*.md must
name a file that exists and, for a Markdown file, a heading it has, slugged as GitHub slugs headings.
"""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


def _doc_files():
    files = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if (ROOT / "CONTRIBUTING.md").exists():
        files.append(ROOT / "CONTRIBUTING.md")
    return files


def _prose_lines(text):
    """The lines outside fenced code blocks (a `#` or a `[x](y)` in a code block is not Markdown)."""
    fence = None
    for line in text.splitlines():
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)[0] * len(marker.group(1))
                continue
            if stripped.startswith(fence):
                fence = None
                continue
        if fence is None:
            yield line


def github_slug(heading):
    """GitHub's anchor for a heading's text: the rendered text (code, emphasis and link markup dropped),
    lowercased, every character but letters, marks, digits, `_`, `-` and space removed, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = "".join(ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(path):
    """Every anchor GitHub gives the headings of a Markdown file (repeats get -1, -2, ...)."""
    seen, result = {}, set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(path):
    """The link targets of a Markdown file's prose (inline code spans dropped: `[a](b)` there is text)."""
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)
        yield from re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)


def dead_links(path, root=ROOT):
    """'FILE: TARGET (why)' for each relative link of `path` that does not resolve (FILE relative to root)."""
    problems = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check offline
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}: {target}"
        if not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} (no heading with that anchor in {dest.relative_to(root)})")
    return problems


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(path):
    assert dead_links(path) == []


def test_dead_links_anchors_and_paths_are_reported(tmp_path):
    (tmp_path / "a.md").write_text("# Top `x`: y\n\n## Top `x`: y\n\n"
                                   "[ok](#top-x-y) [ok](#top-x-y-1) [ok](b.md) ![i](b.md#tail)\n"
                                   "[dead](c.md) [dead](#nope) [dead](b.md#nope) `[not a link](x.md)`\n"
                                   "```\n[in code](d.md)\n# not a heading\n```\n")
    (tmp_path / "b.md").write_text("# Tail\n`hf_scale/tool.py` `tests/gone.py::test_x` "
                                   "`benchmarks/results/x.json`\n")
    (tmp_path / "hf_scale").mkdir()
    (tmp_path / "hf_scale" / "tool.py").write_text("")
    assert missing_repo_paths(tmp_path / "b.md", root=tmp_path) == [
        "b.md: tests/gone.py::test_x (no such file or directory)"]
    assert dead_links(tmp_path / "a.md", root=tmp_path) == [
        "a.md: c.md (no such file)",
        "a.md: #nope (no heading with that anchor in a.md)",
        "a.md: b.md#nope (no heading with that anchor in b.md)",
    ]


def missing_repo_paths(path, root=ROOT):
    """The code and test files a page names in backticks (`hf_scale/train/guard.py`, `tests/test_x.py`) that do
    not exist: a module that moved leaves the page pointing nowhere. Benchmark results (written when a script
    runs) and placeholders (`{a,b}`, `*`) are not files to look for."""
    names = re.findall(r"`((?:hf_scale|tests|benchmarks|\.ci)/[^`\s]*)`", path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(root)}: {name} (no such file or directory)" for name in names
            if not name.startswith("benchmarks/results/") and not re.search(r"[{}*]", name)
            and not (root / name.split("::")[0]).exists()]


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_path_named_exists(path):
    assert missing_repo_paths(path) == []


@pytest.mark.parametrize("heading, slug", [
    ("`--loop trainer` or `--loop accelerate`: which flags each applies",
     "--loop-trainer-or---loop-accelerate-which-flags-each-applies"),
    ("`--hf_scale_config`: one config, no silent override", "--hf_scale_config-one-config-no-silent-override"),
    ("Export a checkpoint: `hf-scale export`", "export-a-checkpoint-hf-scale-export"),
    ("Multi-node, SLURM, FSDP2", "multi-node-slurm-fsdp2"),
])
def test_github_slug_rules(heading, slug):
    assert github_slug(heading) == slug


def test_every_docs_page_is_listed_in_the_index():
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p != index and p.resolve() not in listed]
    assert missing == []


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= README_MAX_LINES


def _commands(lines):
    """The shell commands of a script or a code block: its lines less comments and blanks."""
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_set_up_commands_are_what_ci_runs_in_that_order():
    """The Quickstart's install, demo and test commands are lines of `.ci/run`, in the README's order, and the
    test command is CI's last: what a new user types is what CI proves on a clean clone."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = readme[readme.index("## Quickstart"):]
    block = re.search(r"```bash\n(.*?)```", quickstart, re.S).group(1)
    readme_commands = _commands(block.splitlines())
    ci_commands = _commands((ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines())
    assert [c for c in ci_commands if c in readme_commands] == readme_commands
    assert readme_commands[-1].startswith("python3 -m pytest") and ci_commands[-1] == readme_commands[-1]


def test_the_package_table_of_the_development_page_is_the_import_graph():
    """docs/development.md's package table is generated from the imports (`python3 tests/import_graph.py --write`)."""
    from import_graph import documented_table, package_table

    assert documented_table() == package_table(), "run: python3 tests/import_graph.py --write"
