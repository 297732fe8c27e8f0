from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def small_kv_pools():
    """The tiny models' default pool would be ~2 GiB each (256 sequences x 4096 positions);
    tests use 256 MiB in-process and 64k-token pools in served engines."""
    import tandem.runner.loader as loader
    import tandem.testing.live_server as live_server

    saved = loader.CPU_KV_BYTES, live_server.DEFAULT_KV_BUDGET_TOKENS
    loader.CPU_KV_BYTES, live_server.DEFAULT_KV_BUDGET_TOKENS = 256 << 20, 1 << 16
    yield
    loader.CPU_KV_BYTES, live_server.DEFAULT_KV_BUDGET_TOKENS = saved


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


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory) -> callable:
    """model_type -> path of a tiny model of a family in tandem.testing.families."""
    from tandem.testing.families import make_family_model

    root: Path = tmp_path_factory.mktemp("families")
    made: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in made:
            made[model_type] = make_family_model(root / model_type, model_type)
        return made[model_type]

    return get
