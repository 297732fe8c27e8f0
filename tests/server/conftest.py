from __future__ import annotations

from pathlib import Path

import pytest

from tandem.testing.live_server import Server


@pytest.fixture(scope="session")
def served_model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(served_model):
    s = Server(served_model)
    yield s
    s.stop()
