"""Compile the paged decode kernels' CUDA source with NVRTC on a machine without a GPU: a
syntax and type check of every variant (float and quantized pages; single, split, merge;
one and several query heads a block, 4 and 16 warps) before spending device time.

    pip download --no-deps nvidia-cuda-nvrtc-cu12 -d /tmp/nvrtc
    unzip -o -q -d /tmp/nvrtc /tmp/nvrtc/*.whl
    python scripts/nvrtc_check.py [/tmp/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12]

MLX wraps a kernel's body in a function of its own (typed inputs and outputs, template
values); here a plain ``extern "C"`` function with the template values as macros stands in
(T = float), so a type error specific to bf16 would not show.
"""

from __future__ import annotations

import ctypes
import sys

from tandem.runner import kernel_source as ks
from tandem.runner import kernels

LIB = sys.argv[1] if len(sys.argv) > 1 else "/tmp/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
TYPES = {
    **dict.fromkeys(["q", "kv_pool", "out", "kv_s", "kv_b"], "T"),
    **dict.fromkeys(["scale", "part", "lse"], "float"),
    "kv_q": "uint32_t",
}


def compiles(lib, src: str, name: str) -> bool:
    prog = ctypes.c_void_p()
    assert (
        lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    )
    opts = [b"--gpu-architecture=compute_90", b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    print(name, "ok" if rc == 0 else "FAILED", log.value.decode().strip()[:2000])
    return rc == 0


def wrap(body: str, inputs: list[str], outputs: list[str], template: dict) -> str:
    macros = "".join(f"#define {k} {v}\n" for k, v in template.items())
    params = [f"const {TYPES.get(n, 'int')}* {n}" for n in inputs]
    params += [f"{TYPES.get(n, 'float')}* {n}" for n in outputs]
    head = "typedef float T;\ntypedef unsigned int uint32_t;\n" + macros
    return head + f'extern "C" __global__ void kern({", ".join(params)}) {{\n{body}\n}}\n'


def main() -> int:
    lib = ctypes.CDLL(LIB)
    base = {"H": 32, "HKV": 8, "D": 128, "P": 16, "CHUNK": kernels.CHUNK, "U": kernels.UNROLL}
    ok = True
    for quantized in (False, True):
        body = ks.cuda_body(quantized)
        inputs = kernels._QUANT_INPUTS if quantized else kernels._INPUTS
        extra = {"BITS": 4, "G": 64} if quantized else {}
        for split, outs in ((0, ["out"]), (1, ["part", "lse"])):
            for gq, nw in ((1, kernels.WARPS), (1, kernels.WIDE_WARPS), (4, kernels.WARPS)):
                t = {**base, **extra, "GQ": gq, "NW": nw}
                src = wrap(ks.source(body, "cuda", split), inputs, outs, t)
                ok &= compiles(lib, src, f"quantized{int(quantized)}-split{split}-gq{gq}-nw{nw}")
    merge = wrap(ks.source(ks.MERGE, "cuda", None), ["part", "lse", "offsets"], ["out"], base)
    ok &= compiles(lib, merge, "merge")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
