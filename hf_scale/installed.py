"""What is installed on this node: a distribution's version from its package metadata, without importing it
(importing torch-side packages costs seconds, and a broken install would raise instead of answering)."""

from __future__ import annotations

import importlib.metadata


def version_of(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its pip name, e.g. ``liger-kernel``), or None when not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
