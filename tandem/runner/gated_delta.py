"""The gated delta rule (Gated DeltaNet layers: Qwen3-Next, Qwen3.5, Kimi Linear, ...) as one
CUDA kernel.

mlx-lm runs the recurrence as a Metal kernel on Apple GPUs and otherwise as MLX ops in a Python
loop over the sequence: about ten kernels per token per layer, so on MLX's CUDA backend a
prefill chunk of n tokens costs ~10 n launches per layer (host-bound: a 256-token chunk of a
24-layer hybrid launches ~45k kernels). Here one warp owns one row (batch, value head, value
dim) of the (Dv, Dk) state, each lane Dk / 32 of its columns in registers, and walks the
chunk's tokens in order: decay, read out k, the delta update, read out q, with two warp
reductions per token. State stays float32 as in mlx-lm.

``install(model)`` puts ``update`` at the ``gated_delta_update`` seam of every mlx-lm module
the model's layers come from. The kernel runs on the CUDA backend only, and only after it
matched mlx-lm's ops on a random case (scalar and per-key gating). It is used only inside
Tandem's own model calls (``active()``): mlx-lm's code in the same process (a benchmark's
baseline) keeps its own path, and so does anything the kernel does not handle (a padding mask,
key dims not a multiple of 32). ``TANDEM_GATED_DELTA_KERNEL=0`` turns it off. Where a call
captures each position's state (a speculative verify, runner/positions.py), a variant of the
kernel writes every position's state in the same launch (used once it gave, on random cases,
exactly the kernel's states run to each length); without it the recurrence runs position by
position, on the kernel or mlx-lm's own path, and hands over every state.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as mlx_gd

from tandem.runner import positions
from tandem.runner.layers import model_modules

log = logging.getLogger("tandem")

SEAM = "gated_delta_update"

_BODY = """
    const int E = DK / 32;
    const int B = dims[0];
    const int TT = dims[1];
    int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (w >= B * HV * DV) return;
    int dv = w % DV;
    int h = (w / DV) % HV;
    int b = w / (DV * HV);
    int hk = h / (HV / HK);
    size_t srow = (((size_t)b * HV + h) * DV + dv) * DK;
    float s[E];
    for (int e = 0; e < E; ++e) s[e] = state_in[srow + lane + 32 * e];
    for (int t = 0; t < TT; ++t) {
        size_t qk = (((size_t)b * TT + t) * HK + hk) * DK;
        size_t bh = ((size_t)b * TT + t) * HV + h;
        float gs = GVEC ? 0.0f : static_cast<float>(g[bh]);
        float kv = 0.0f;
        for (int e = 0; e < E; ++e) {
            int i = lane + 32 * e;
            float decay = GVEC ? static_cast<float>(g[bh * DK + i]) : gs;
            s[e] *= decay;
            kv += s[e] * static_cast<float>(k[qk + i]);
        }
        for (int off = 16; off > 0; off /= 2) kv += __shfl_xor_sync(0xffffffff, kv, off);
        float delta = (static_cast<float>(v[bh * DV + dv]) - kv) * static_cast<float>(beta[bh]);
        float yv = 0.0f;
        for (int e = 0; e < E; ++e) {
            int i = lane + 32 * e;
            s[e] += static_cast<float>(k[qk + i]) * delta;
            yv += s[e] * static_cast<float>(q[qk + i]);
        }
        for (int off = 16; off > 0; off /= 2) yv += __shfl_xor_sync(0xffffffff, yv, off);
        if (lane == 0) y[bh * DV + dv] = static_cast<T>(yv);
        /*EACH*/
    }
    for (int e = 0; e < E; ++e) state_out[srow + lane + 32 * e] = s[e];
"""
# The variant that also writes the state after every position (a capturing verify,
# runner/positions.py): states (B, T, HV, DV, DK), in the same launch.
_EACH = """
        size_t at = ((((size_t)b * TT + t) * HV + h) * DV + dv) * DK;
        for (int e = 0; e < E; ++e) states[at + lane + 32 * e] = s[e];
"""

_kernels: dict[bool, object] = {}  # each -> the kernel (built on first use)
_checked: dict[str, bool] = {}
# Open while Tandem's runner calls the model (MLX is driven from one thread). The seam is a
# module-level function mlx-lm's layers call with fixed arguments, so whose call it is cannot
# travel with them; a benchmark's mlx-lm baseline in the same process calls it outside.
_active = [False]
_kernel_on = [False]  # the kernel passed its check (install)


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Tandem's model call: installed seams use the kernel while this is open."""
    _active[0] = True
    try:
        yield
    finally:
        _active[0] = False
        positions.aim(None)  # (a call that raised leaves no capture behind)


def _build(each: bool = False):
    if each not in _kernels:
        _kernels[each] = mx.fast.cuda_kernel(
            name="tandem_gated_delta_each" if each else "tandem_gated_delta",
            input_names=["q", "k", "v", "g", "beta", "state_in", "dims"],
            output_names=["y", "state_out", *(["states"] if each else [])],
            source=_BODY.replace("/*EACH*/", _EACH if each else ""),
        )
    return _kernels[each]


def recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    each: bool = False,
) -> list[mx.array]:
    """q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g (B, T, Hv) or (B, T, Hv, Dk); beta (B, T, Hv);
    state (B, Hv, Dv, Dk) -> y (B, T, Hv, Dv) in q's dtype, the new state in float32 and,
    with ``each``, the state after every position (B, T, Hv, Dv, Dk)."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    warps = b * hv * dv
    return _build(each)(
        inputs=[q, k, v, g, beta, state.astype(mx.float32), mx.array([b, t], dtype=mx.int32)],
        template=[
            ("T", q.dtype),
            ("HK", hk),
            ("HV", hv),
            ("DK", dk),
            ("DV", dv),
            ("GVEC", int(g.ndim == 4)),
        ],
        grid=(-(-warps // 4) * 128, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(b, t, hv, dv), (b, hv, dv, dk), *([(b, t, hv, dv, dk)] if each else [])],
        output_dtypes=[q.dtype, mx.float32, *([mx.float32] if each else [])],
    )


def update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,  # noqa: N803 - mlx-lm's name
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``gated_delta_update``, the recurrence on the CUDA kernel where installed;
    where the call captures each position's state (runner/positions.py), the kernel's
    variant that writes them all in one launch, or else position by position."""
    capture = positions.current() if _active[0] and mask is None else None
    kernel = (
        _active[0]
        and _kernel_on[0]
        and mask is None
        and use_kernel
        and not q.shape[-1] % 32
        and not v.shape[-2] % k.shape[-2]
    )
    if capture is None and not kernel:
        return mlx_gd.gated_delta_update(
            q,
            k,
            v,
            a,
            b,
            A_log,
            dt_bias,
            state,
            mask,
            use_kernel=use_kernel,
            lower_bound=lower_bound,
            allow_neg_eigval=allow_neg_eigval,
        )
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = mlx_gd.compute_g(A_log, a, dt_bias)
    else:
        g = mlx_gd.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    if state is None:
        bsz, _, _, dk = q.shape
        hv, dv = v.shape[-2:]
        state = mx.zeros((bsz, hv, dv, dk), dtype=mx.float32)
    if capture is None:
        y, state = recurrence(q, k, v, g, beta, state)
        return y, state
    if kernel and _checked.get("each"):  # one launch, every position's state on the way
        y, state, every = recurrence(q, k, v, g, beta, state, each=True)
        # Arrays of their own (a copy where a slice is not contiguous, i.e. B > 1), so a
        # held position does not keep the whole (B, T, ...) buffer (runner/state.py).
        capture.states = [mx.contiguous(every[:, t]) for t in range(q.shape[1])]
        return y, state
    # Each position alone, as the recurrence would run it (mlx-lm's ops loop the same way).
    ys, states = [], []
    for t in range(q.shape[1]):
        x = (q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1])
        if kernel:
            y, state = recurrence(*x, state)
        elif (
            use_kernel
            and mx.default_device() == mx.gpu
            and mx.metal.is_available()
            and (q.shape[-1] >= 32 and not q.shape[-1] % 32)
        ):  # mlx-lm's own choice of its Metal kernel
            y, state = mlx_gd.gated_delta_kernel(*x, state, None)
        else:
            y, state = mlx_gd.gated_delta_ops(*x, state, None)
        ys.append(y)
        states.append(state)
    capture.states = states
    return mx.concatenate(ys, axis=1), state


def available() -> bool:
    """On the CUDA backend, once: whether the kernel matches mlx-lm's ops on random cases."""
    if "ok" not in _checked:
        ok = False
        off = os.environ.get("TANDEM_GATED_DELTA_KERNEL") == "0"
        if not off and mx.default_device() == mx.gpu and mx.cuda.is_available():
            try:
                ok = all(
                    _check(vec, dtype)
                    for vec in (False, True)
                    for dtype in (mx.float32, mx.bfloat16)
                )
            except Exception as e:  # noqa: BLE001 - any failure: mlx-lm's ops are used
                log.warning("gated delta kernel unavailable (%s: %s)", type(e).__name__, e)
        _checked["ok"] = ok
        each = False
        if ok:  # its variant for capturing verifies (else they launch it per position)
            try:
                each = all(
                    _check_each(vec, dtype)
                    for vec in (False, True)
                    for dtype in (mx.float32, mx.bfloat16)
                )
            except Exception as e:  # noqa: BLE001
                log.warning("gated delta kernel: no per-position variant (%s)", e)
        _checked["each"] = each
        if each:
            log.info("gated delta kernel: a verify keeps every position's state in one launch")
    return _checked["ok"]


def _case(vector_gate: bool, dtype: mx.Dtype) -> tuple[mx.array, ...]:
    """Random q, k, v, g, beta and state for the checks."""
    bsz, t, hk, hv, dk, dv = 2, 7, 2, 4, 64, 32
    keys = mx.random.split(mx.random.key(3), 6)
    q = mx.random.normal((bsz, t, hk, dk), key=keys[0]).astype(dtype) * 0.3
    k = mx.random.normal((bsz, t, hk, dk), key=keys[1]).astype(dtype) * 0.3
    v = mx.random.normal((bsz, t, hv, dv), key=keys[2]).astype(dtype)
    shape = (bsz, t, hv, dk) if vector_gate else (bsz, t, hv)
    g = mx.random.uniform(0.5, 1.0, shape, key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (bsz, t, hv), key=keys[4])
    state = mx.random.normal((bsz, hv, dv, dk), key=keys[5])
    return q, k, v, g, beta, state


def _check(vector_gate: bool, dtype: mx.Dtype) -> bool:
    q, k, v, g, beta, state = _case(vector_gate, dtype)
    y, s = recurrence(q, k, v, g, beta, state)
    y_ref, s_ref = mlx_gd.gated_delta_ops(q, k, v, g, beta, state)
    # float32 arithmetic in both, summed in another order; y then rounds to q's dtype.
    tol = 1e-4 if dtype == mx.float32 else 1e-2
    y, y_ref = y.astype(mx.float32), y_ref.astype(mx.float32)
    ok = bool(mx.allclose(y, y_ref, atol=tol, rtol=tol)) and bool(
        mx.allclose(s, s_ref, atol=1e-4, rtol=1e-4)
    )
    if not ok:
        err = float(mx.max(mx.abs(y.astype(mx.float32) - y_ref.astype(mx.float32))))
        log.warning("gated delta kernel disagrees with mlx-lm's ops (%.3g); not used", err)
    return ok


def _check_each(vector_gate: bool, dtype: mx.Dtype) -> bool:
    """The variant writing every position's state against what a capturing call ran before
    it (and still runs without it): the kernel launched once per position, each launch from
    the state the last one left. The same arithmetic in the same order: equal outputs, and
    the state after position j equal to the j-th launch's."""
    q, k, v, g, beta, state = _case(vector_gate, dtype)
    y_each, s_each, every = recurrence(q, k, v, g, beta, state, each=True)
    ys, s = [], state
    ok = True
    for j in range(q.shape[1]):
        x = (q[:, j : j + 1], k[:, j : j + 1], v[:, j : j + 1], g[:, j : j + 1], beta[:, j : j + 1])
        y, s = recurrence(*x, s)
        ys.append(y)
        ok = ok and bool(mx.array_equal(every[:, j], s))
    ok = ok and bool(mx.array_equal(y_each, mx.concatenate(ys, axis=1)))
    ok = ok and bool(mx.array_equal(s_each, s))
    if not ok:
        log.warning("gated delta kernel: its per-position variant disagrees; not used")
    return ok


def install(model: nn.Module) -> bool:
    """Route the model's gated delta recurrences through ``update`` (which captures each
    position's state where asked, runner/positions.py, and runs the CUDA kernel where it
    passes its check); True when the kernel is used (the load check then allows for its
    other summation order)."""
    modules = [
        m
        for m in model_modules(model).values()
        # ``update`` already: a model of the same family loaded before in this process.
        if getattr(m, SEAM, None) in (mlx_gd.gated_delta_update, update)
    ]
    if not modules:
        return False
    for module in modules:
        module.__dict__[SEAM] = update
    _kernel_on[0] = available()
    if _kernel_on[0]:
        log.info("gated delta recurrence: Tandem's CUDA kernel")
    return _kernel_on[0]
