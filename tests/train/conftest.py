"""Shared by the one-process ``mode train`` tests: a small text corpus (this repository's data module, three times)."""

from __future__ import annotations

from pathlib import Path

import pytest

import mode.train.data


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(Path(mode.train.data.__file__).read_text() * 3)
    return path
