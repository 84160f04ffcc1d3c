"""hf_scale.clusters' registry is the one place that names the cluster targets: every consumer (generate's
--targets and help, check --manifest, the docs) reads it, each target is its own module with its test and its
section in docs/launch.md (CONTRIBUTING.md, "Adding a cluster target")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from import_graph import import_graph
from test_docs import github_slug

import hf_scale
from hf_scale import clusters
from hf_scale.clusters import CHOSEN, MANIFEST_KINDS, PLATFORM_VARIABLES, TARGETS
from hf_scale.clusters.target import NODES, PER_NODE

PACKAGE = Path(hf_scale.__file__).parent
ROOT = PACKAGE.parent
NAMES = tuple(target.name for target in TARGETS)
KINDS = tuple(kind.kind for kind in MANIFEST_KINDS)
NOT_A_TARGET = {("hf_scale/commands/ray_train.py", "ray"): "the ray:// scheme of a Ray Client address"}
"""String literals outside hf_scale/clusters that equal a target's name but mean something else (each with why)."""


def _strings(source: str) -> list[tuple[int, str]]:
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def targets_named(source: str, path: str) -> list[str]:
    """Where a module names a target in a string literal: the literal is a target's name, or lists two or more
    (a help text or a message that repeats the registry)."""
    words = re.compile(r"(?<![\w.\-/])(" + "|".join(NAMES) + r")(?![\w\-/\[])")
    found = []
    for line, text in _strings(source):
        if (text in NAMES and (path, text) not in NOT_A_TARGET) or len(set(words.findall(text))) >= 2:
            found.append(f"{path}:{line}: {text[:80]!r}")
    return found


def kinds_compared(source: str, path: str) -> list[str]:
    """Where a module branches on a manifest kind written out (``kind == "TrainJob"``) instead of the target's
    constant (``kubeflow.KIND``)."""
    return [f"{path}:{node.lineno}" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            for side in (node.left, *node.comparators)
            if isinstance(side, ast.Constant) and side.value in KINDS]


def _outside_clusters() -> list[tuple[str, str]]:
    return [(str(path.relative_to(ROOT)), path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))
            if "clusters" not in path.relative_to(PACKAGE).parts[:1]]


def test_no_module_outside_hf_scale_clusters_names_a_target():
    found = [hit for path, source in _outside_clusters() for hit in targets_named(source, path)]
    assert found == [], "read the names from hf_scale.clusters.TARGETS"


def test_no_module_outside_hf_scale_clusters_branches_on_a_manifest_kind_written_out():
    found = [hit for path, source in _outside_clusters() for hit in kinds_compared(source, path)]
    assert found == [], "compare with the target module's KIND"


def test_the_scans_see_a_target_and_a_kind_written_out():
    assert targets_named('TARGETS = ("kubeflow", "docker")\n', "m.py") == [
        "m.py:1: 'kubeflow'", "m.py:1: 'docker'"]
    assert targets_named('HELP = "needs the kubeflow, pytorchjob and docker targets"\n', "m.py") != []
    assert targets_named('"pip install \'hf-scale[ray]\'"\n"ray start --head"\n', "m.py") == []
    assert kinds_compared('if kind == "SkyPilot": pass\n', "m.py") == ["m.py:1"]
    assert kinds_compared("if kind == skypilot.KIND: pass\n", "m.py") == []
    assert kind_constants("from hf_scale.clusters.skypilot import KIND\nif kind == KIND: pass\n", "m.py") == [
        "m.py:2"]


REGISTRY = {"hf_scale.clusters", "hf_scale.clusters.target"}
"""What hf_scale.check may import of hf_scale.clusters: the registry and the record of a target and its manifests."""


def kind_constants(source: str, path: str) -> list[str]:
    """Where a module uses a target's manifest kind constant (``skypilot.KIND``, an imported ``KIND``)."""
    return [f"{path}:{node.lineno}" for node in ast.walk(ast.parse(source))
            if (isinstance(node, ast.Attribute) and node.attr == "KIND") or (isinstance(node, ast.Name)
                                                                             and node.id == "KIND")]


def test_check_reads_a_manifest_only_through_the_kind_the_registry_recognised():
    """hf_scale.check imports no target's module (lazily neither: the import graph has every import) and uses no
    kind's constant: what differs between manifest kinds (their fields, their schema, the refusing tool, how a
    secret is passed, their image and restart rules) is the kind's ManifestKind, so a target with a new kind of
    manifest changes nothing in check."""
    found = [f"{module} imports {imported}" for module, imports in sorted(import_graph().items())
             if module.startswith("hf_scale.check") for imported in sorted(imports)
             if imported.startswith("hf_scale.clusters") and imported not in REGISTRY]
    found += [hit for path in sorted((PACKAGE / "check").rglob("*.py"))
              for hit in kind_constants(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "ask the ManifestKind (hf_scale.clusters.recognised_manifest) instead"


@pytest.mark.parametrize("target", TARGETS, ids=NAMES)
def test_each_target_is_its_own_module_with_its_test(target):
    module = PACKAGE / "clusters" / f"{target.name}.py"
    assert module.is_file()
    assert getattr(clusters, target.name).TARGET is target
    imports = re.compile(rf"from hf_scale\.clusters(\.{target.name} import| import .*\b{target.name}\b)")
    tests = [path.name for path in (ROOT / "tests" / "clusters").glob("test_*.py") if imports.search(path.read_text())]
    assert tests, f"no test in tests/clusters imports hf_scale.clusters.{target.name}"


def test_every_module_of_hf_scale_clusters_is_a_target_or_says_what_it_shares():
    shared = {"__init__", "target", "kubernetes"}  # the registry, the record, the two Kubernetes targets' code
    modules = {path.stem for path in (PACKAGE / "clusters").glob("*.py")}
    assert modules - shared == set(NAMES)


def test_docs_launch_has_a_section_per_target():
    text = (ROOT / "docs" / "launch.md").read_text()
    anchors = {github_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    missing = [target.name for target in TARGETS if target.doc_anchor not in anchors]
    assert missing == [], "each target has its section in docs/launch.md (its doc_anchor)"
    listed = re.search(r"--targets ([a-z,]+)", text)[1].split(",")
    assert listed == list(CHOSEN)


def test_docs_check_lists_the_node_variables_of_every_engine():
    """docs/check.md's table of the counts each engine sets on every node is the registry's PLATFORM_VARIABLES (each
    target's node_variables), row by row in the registry's order."""
    text = (ROOT / "docs" / "check.md").read_text()
    table = text[text.index("| engine | nodes | processes (GPUs) per node |"):].split("\n\n")[0].splitlines()[2:]
    documented = {}
    for row in table:
        engine, nodes, per_node = (cell.strip() for cell in row.strip("|").split("|"))
        for counts, cell in ((NODES, nodes), (PER_NODE, per_node)):
            documented.update({variable: (engine, counts) for variable in re.findall(r"`(\w+)`", cell)})
    assert documented == PLATFORM_VARIABLES
    engines = [row.split("|")[1].strip() for row in table]
    assert engines == list(dict.fromkeys(engine for engine, _ in PLATFORM_VARIABLES.values()))


def test_generate_offers_every_chosen_target_and_lists_every_target_in_its_help(capsys):
    from hf_scale.commands.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    for target in TARGETS:
        assert f"{target.writes} " in help_text and target.summary in help_text
    with pytest.raises(SystemExit):
        main(["generate", "--preset", "ddp", "--targets", "nowhere"])
    assert f"allowed: a comma-separated list of {', '.join(CHOSEN)}" in capsys.readouterr().err


def test_check_recognises_each_registered_manifest_kind():
    from hf_scale.check.cluster import manifest_kind

    documents = {"TrainJob": {"kind": "TrainJob"}, "PyTorchJob": {"kind": "PyTorchJob"}, "SkyPilot": {"run": "x"}}
    assert {kind: manifest_kind(data) for kind, data in documents.items()} == {kind: kind for kind in KINDS}
