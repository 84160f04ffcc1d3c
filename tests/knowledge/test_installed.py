"""hf_scale.knowledge.installed: a distribution's version from its metadata, None when it is not installed."""

from __future__ import annotations

from hf_scale.knowledge.installed import version_of


def test_an_installed_distribution_has_its_metadata_version_and_a_missing_one_none():
    import accelerate
    import xdist

    assert version_of("accelerate") == accelerate.__version__
    assert version_of("pytest-xdist") == xdist.__version__  # a pip name with a dash, not the import name
    assert version_of("hf-scale-no-such-distribution") is None
