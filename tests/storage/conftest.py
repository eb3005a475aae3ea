"""Fixtures for the storage tests (helpers live in _storage_support.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
