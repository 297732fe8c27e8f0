"""glibc's top pad (runner/malloc.py): set once on glibc, never over the user's own setting
or with the opt-out."""

import platform
import sys

import pytest

from tandem.runner import malloc

glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(malloc, "_done", None)
    monkeypatch.delenv(malloc.OPT_OUT_ENV, raising=False)
    for var in ("MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # not one of ours
    return monkeypatch


@pytest.mark.skipif(not glibc, reason="glibc only")
def test_set_on_glibc_once(fresh):
    calls = []
    real = malloc.ctypes.CDLL

    class Libc:
        def __init__(self, name):
            self._lib = real(name)

        def mallopt(self, param, value):
            calls.append((param, value))
            return self._lib.mallopt(param, value)

    fresh.setattr(malloc.ctypes, "CDLL", Libc)
    assert malloc.tune_malloc() is True
    assert malloc.tune_malloc() is True
    assert calls == [
        (malloc.M_MMAP_THRESHOLD, malloc.MMAP_THRESHOLD),
        (malloc.M_TOP_PAD, malloc.TOP_PAD),
    ]
    # glibc's own numbers (malloc.h); mallopt accepts unknown ones, so check them here
    assert (malloc.M_TOP_PAD, malloc.M_MMAP_THRESHOLD) == (-2, -3)


@pytest.mark.parametrize(
    ("var", "value"), [("TANDEM_NO_MALLOC_TUNING", "1"), ("MALLOC_TOP_PAD_", "0")]
)
def test_not_set_over_the_user(fresh, var, value):
    fresh.setenv(var, value)
    fresh.setattr(malloc.ctypes, "CDLL", lambda name: pytest.fail("mallopt called"))
    assert malloc.tune_malloc() is False


def test_not_on_other_libcs(fresh):
    fresh.setattr(malloc.platform, "libc_ver", lambda: ("", ""))
    fresh.setattr(malloc.ctypes, "CDLL", lambda name: pytest.fail("mallopt called"))
    assert malloc.tune_malloc() is False


@pytest.mark.skipif(not glibc, reason="glibc only")
def test_zero_is_not_an_opt_out_and_a_refusal_is_reported(fresh):
    fresh.setenv(malloc.OPT_OUT_ENV, "0")

    class Refuses:
        def __init__(self, name):
            pass

        def mallopt(self, param, value):
            return 0

    fresh.setattr(malloc.ctypes, "CDLL", Refuses)
    assert malloc.tune_malloc() is False
