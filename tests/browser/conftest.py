from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def served_model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")
