"""hf_scale's import graph, read from the source with `ast` (nothing is imported): every `import` and
`from ... import`, at module level and inside functions alike (a lazy import is still a dependency), plus the commands
the CLI loads by name (`cli.COMMANDS`); and the package layers it must respect.

tests/test_import_graph.py holds the graph to its rules; `python3 tests/import_graph.py --write` regenerates the
package table of docs/development.md from it (tests/test_docs.py fails when the page and the code disagree).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import hf_scale
from hf_scale.commands.cli import COMMANDS

PACKAGE = Path(hf_scale.__file__).parent

def modules() -> dict[str, Path]:
    modules = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return modules


def _imported(node: ast.AST, package: str, modules: dict[str, Path]) -> set[str]:
    """The hf_scale modules an import statement reaches: `from a import b` reaches the submodule a.b when
    there is one, else the module a itself."""
    if isinstance(node, ast.Import):
        return {_owner(alias.name, modules) for alias in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, base] if base else parent)
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _owner(base, modules) for a in node.names}


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The hf_scale module defining `name` (None outside hf_scale)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """{module: the hf_scale modules it imports}."""
    found = modules()
    graph = {}
    for name, file in found.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            targets |= _imported(node, package, found)
        graph[name] = frozenset(targets - {None, name})
    graph["hf_scale.commands.cli"] |= {module for module, _ in COMMANDS.values()}
    return graph


LAYERS = (
    ("hf_scale.errors", "hf_scale.exit_codes"),
    ("hf_scale", "hf_scale.quiet", "hf_scale.config", "hf_scale.knowledge", "hf_scale.contract", "hf_scale.files"),
    ("hf_scale.generators", "hf_scale.clusters", "hf_scale.planner"),
    ("hf_scale.train",),
    ("hf_scale.check", "hf_scale.doctor", "hf_scale.export"),
    ("hf_scale.commands", "hf_scale.train.__main__"),
    ("hf_scale.commands.cli", "hf_scale.__main__"),
)
"""hf_scale's packages, lowest first: how processes fail and exit; the base (the config, the knowledge of the libraries,
train.py's contract, files); what is derived from a config (generated files, cluster targets' files, plans); the
training runtime; the libraries of the commands that read a run's files (check, doctor, export); the commands (and the
`python -m` entry points); the CLI that loads them by name."""


def layer(module: str) -> int:
    """The index in LAYERS of the longest package or module name that `module` is or sits in."""
    best, found = -1, 0
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    return found


def package_of(module: str) -> str:
    """The package a module is listed under: hf_scale.X, the runtime's rooms hf_scale.train.X (the CLI, the `python -m`
    entry points and the top-level modules by themselves)."""
    parts = module.split(".")
    if module == "hf_scale.commands.cli" or parts[-1] == "__main__" or len(parts) <= 2:
        return module
    if parts[1] == "train" and len(parts) >= 4:  # the runtime by its rooms (tests/test_import_graph.py)
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def package_table() -> str:
    """docs/development.md's table of packages, highest layer first: each package's modules and what it imports."""
    graph = import_graph()
    members: dict[str, list[str]] = {}
    for module in graph:
        members.setdefault(package_of(module), []).append(module)
    uses: dict[str, set[str]] = {package: set() for package in members}
    for module, targets in graph.items():
        uses[package_of(module)] |= {package_of(t) for t in targets} - {package_of(module)}
    rows = ["| layer | package | modules | imports from |", "|---|---|---|---|"]
    for package in sorted(members, key=lambda p: (-layer(p), p)):
        names = sorted(m.rpartition(".")[2] for m in members[package] if m != package)
        shown = ", ".join(names) if names else "—"
        imports = ", ".join(f"`{used.removeprefix('hf_scale.')}`"
                            for used in sorted(uses[package], key=lambda p: (-layer(p), p)))
        rows.append(f"| {layer(package)} | `{package}` | {shown} | {imports or '—'} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- package table: python3 tests/import_graph.py --write -->\n", "<!-- end of package table -->\n"
DOC = PACKAGE.parent / "docs" / "development.md"


def documented_table() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)]


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write"]:
        text = DOC.read_text()
        DOC.write_text(text[:text.index(BEGIN) + len(BEGIN)] + package_table() + text[text.index(END):])
    else:
        print(package_table(), end="")
