"""Read the header and metadata key/values of a GGUF file, in plain Python.

Layout (GGUF v2/v3, little-endian): magic ``b"GGUF"``, uint32 version, uint64 tensor
count, uint64 key/value count, then that many pairs of (string key, uint32 value type,
value). Strings are a uint64 byte length plus UTF-8 bytes; arrays are a uint32 element
type, a uint64 count and the elements. Tensor infos and tensor data follow; they are not
read here.
"""

from __future__ import annotations

import os
import struct
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

_STRING = 8
_ARRAY = 9
# value type -> (struct format, byte size) for the fixed-size scalar types
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1),  # uint8
    1: ("b", 1),  # int8
    2: ("H", 2),  # uint16
    3: ("h", 2),  # int16
    4: ("I", 4),  # uint32
    5: ("i", 4),  # int32
    6: ("f", 4),  # float32
    7: ("?", 1),  # bool
    10: ("Q", 8),  # uint64
    11: ("q", 8),  # int64
    12: ("d", 8),  # float64
}


class GGUFError(ValueError):
    """A GGUF file is missing, malformed or uses something tandem does not support."""


class _Reader:
    def __init__(self, f: BinaryIO, path: str, size: int) -> None:
        self._f = f
        self._path = path
        self._size = size
        self._pos = 0

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(f"{self._path}: {problem}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self._pos + n > self._size:
            raise self.fail(
                f"truncated file: {what} needs {n} bytes at offset {self._pos}, "
                f"but the file has {self._size} bytes"
            )

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self._f.read(n)
        if len(data) != n:
            raise self.fail(f"truncated file: short read of {what} at offset {self._pos}")
        self._pos += n
        return data

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        return struct.unpack("<" + fmt, self.read(size, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", 8, what)
        raw = self.read(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.scalar(fmt, size, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar("I", 4, what)
            count = self.scalar("Q", 8, what)
            if etype in _SCALARS:
                fmt, size = _SCALARS[etype]
                raw = self.read(count * size, what)
                return list(struct.unpack(f"<{count}{fmt}", raw))
            if etype in (_STRING, _ARRAY):
                # Each element takes at least 8 bytes: reject absurd counts before looping.
                self.need(count * 8, what)
                return [self.value(etype, what) for _ in range(count)]
            raise self.fail(f"{what}: unknown array element type {etype}")
        raise self.fail(f"{what}: unknown value type {vtype}")


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the metadata key/values of the GGUF file at ``path`` as plain Python values.

    Integers and bools come back as ``int``/``bool``, floats as ``float``, strings as
    ``str`` and arrays as ``list``. Raises :class:`GGUFError` naming the file for a missing
    file, a bad magic, an unsupported version or a truncated/corrupt header.
    """
    name = os.fspath(path)
    try:
        size = os.path.getsize(name)
        f = open(name, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise GGUFError(f"{name}: no such file") from None
    except OSError as e:
        raise GGUFError(f"{name}: cannot open ({e.strerror or e})") from None
    with f:
        r = _Reader(f, name, size)
        magic = r.read(4, "magic") if size >= 4 else b""
        if magic != GGUF_MAGIC:
            raise r.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        version = r.scalar("I", 4, "version")
        if struct.unpack(">I", struct.pack("<I", version))[0] in SUPPORTED_VERSIONS:
            raise r.fail("big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise r.fail(
                f"unsupported GGUF version {version} (supported: "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))})"
            )
        r.scalar("Q", 8, "tensor count")
        kv_count = r.scalar("Q", 8, "metadata count")
        meta: dict[str, Any] = {}
        for i in range(kv_count):
            key = r.string(f"metadata key #{i}")
            vtype = r.scalar("I", 4, f"type of {key!r}")
            meta[key] = r.value(vtype, f"value of {key!r}")
        return meta
