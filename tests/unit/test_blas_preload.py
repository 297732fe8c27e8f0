"""The BLAS preload (runner/blas.py) without loading anything: what it sets and loads."""

from __future__ import annotations

import sys

from tandem.runner import blas


def test_preload_sets_openblas_idle_spin_unless_the_user_did(monkeypatch, tmp_path):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    loaded: list[str] = []
    monkeypatch.setattr(blas.ctypes, "CDLL", lambda path, mode: loaded.append(path))
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    monkeypatch.setenv("TANDEM_BLAS_PATH", str(lib))
    monkeypatch.delenv(blas.OPT_OUT_ENV, raising=False)
    for spun, want in ((None, "4"), ("20", "20")):
        monkeypatch.setattr(blas, "_loaded", None)
        if spun is None:
            monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
        else:
            monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", spun)
        assert blas.preload_blas() == str(lib)
        assert blas.os.environ["OPENBLAS_THREAD_TIMEOUT"] == want
    assert loaded == [str(lib), str(lib)]
