"""Where things are, for test files at any depth under tests/ (importable from every folder: pytest's
`pythonpath = ["tests"]`)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
"""tests/: the shared helpers, the multi-process workers (`_*_worker.py`) and the test data (`data/`)."""
REPO = TESTS.parent
TEST_DATA = TESTS / "data"
TINY_LLAMA = REPO / "hf_scale" / "assets" / "tiny-llama"
