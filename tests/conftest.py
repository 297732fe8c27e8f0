from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> callable:
    """arch -> path of a float32 random-weight model written once per session."""
    from tandem.testing.tiny_models import make_tiny_model

    root: Path = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(root / arch, arch)
        return made[arch]

    return get
