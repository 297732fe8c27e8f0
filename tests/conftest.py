from __future__ import annotations

from pathlib import Path

import pytest

# Before any test module imports mlx: the optimized BLAS must be loaded first (float32 matmuls
# ~35x faster than MLX's bundled reference BLAS), whichever module pytest collects first.
import tandem.runner  # noqa: F401, I001


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


def _written_once(tmp_path_factory, folder: str, make) -> callable:
    """name -> path of a model ``make(path, name)`` wrote, once per session."""
    root: Path = tmp_path_factory.mktemp(folder)
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make(root / name, name)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> callable:
    """arch -> path of a float32 random-weight model written once per session."""
    from tandem.testing.tiny_models import make_tiny_model

    return _written_once(tmp_path_factory, "models", make_tiny_model)


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory) -> callable:
    """model_type -> path of a tiny model of a family in tandem.testing.families."""
    from tandem.testing.families import make_family_model

    return _written_once(tmp_path_factory, "families", make_family_model)
