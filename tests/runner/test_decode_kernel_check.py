"""The decode kernel's grouped split variant (runner/kernels.py ``grouped``) and its start-up
check's fallback (runner/kernel_check.py): the kernels themselves run on CUDA only
(``scripts/gpu_kernel_check.py``); here the choice of layout and what a failed check does."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.runner import kernel_check, kernels


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(kernels, "UNGROUPED", set())
    monkeypatch.setattr(kernels, "NARROW", set())


def test_grouping_where_registers_and_shared_memory_allow():
    assert kernels.grouped(32, 8, 128) == 4  # Qwen3-8B
    assert kernels.grouped(64, 8, 128) == 8
    assert kernels.grouped(40, 8, 128) == 5
    assert kernels.grouped(16, 16, 128) == 1  # no KV head shared
    assert kernels.grouped(16, 2, 256) == 1  # 8 heads x 8 values a lane: too many registers
    assert kernels.grouped(128, 8, 128) == 1  # 16 heads x 4 values a lane: too many


def _patched(monkeypatch, agrees):
    """``_check_case`` replaced: ``agrees(layout)`` decides; returns the layouts checked,
    ("single", warps) or ("split", query heads a block)."""
    seen: list[tuple[str, int]] = []

    def case(d, h, hkv, dtype, lengths, quant, warps=None):
        if max(lengths) > kernel_check.CHUNK:
            layout = ("split", kernels.grouped(h, hkv, d, quant is not None, dtype))
        else:
            layout = ("single", warps)
        seen.append(layout)
        return agrees(layout)

    monkeypatch.setattr(kernel_check, "_check_case", case)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    return seen


SINGLE = [("single", kernels.WARPS), ("single", kernels.WIDE_WARPS)]


def test_a_failing_grouped_split_is_checked_again_one_head_a_block(monkeypatch):
    seen = _patched(monkeypatch, lambda layout: layout != ("split", 4))
    assert kernel_check._checked_variants(128, 32, 8, mx.bfloat16, None)
    assert seen == [*SINGLE, ("split", 4), ("split", 1)]
    assert kernels.grouped(32, 8, 128) == 1
    assert kernels.grouped(32, 8, 128, quantized=True) == 4  # (each checked on its own)
    assert kernels.grouped(32, 8, 128, dtype=mx.float16) == 4


def test_a_failing_wide_single_variant_runs_narrow(monkeypatch):
    seen = _patched(monkeypatch, lambda layout: layout != ("single", kernels.WIDE_WARPS))
    assert kernel_check._checked_variants(128, 32, 8, mx.bfloat16, None)
    assert seen == [*SINGLE, ("split", 4)]
    shape = (32, 8, 128, False, mx.bfloat16)
    assert kernels.single_warps(32, shape) == kernels.WARPS
    assert kernels.single_warps(32, (32, 8, 128, True, mx.bfloat16)) == kernels.WIDE_WARPS


def test_a_failing_narrow_single_variant_gives_the_kernel_up(monkeypatch):
    seen = _patched(monkeypatch, lambda layout: layout[0] == "split")
    assert not kernel_check._checked_variants(128, 32, 8, mx.bfloat16, None)
    assert seen == SINGLE[:1] and not kernels.UNGROUPED and not kernels.NARROW


def test_a_failure_without_grouping_gives_the_kernel_up(monkeypatch):
    def fails(layout):
        if layout[0] == "split":
            raise RuntimeError("the kernel did not compile")
        return True

    seen = _patched(monkeypatch, fails)
    assert not kernel_check._checked_variants(128, 16, 16, mx.bfloat16, None)
    assert seen == [*SINGLE, ("split", 1)]
    seen.clear()
    assert not kernel_check._checked_variants(128, 32, 8, mx.bfloat16, None)
    assert seen == [*SINGLE, ("split", 4), ("split", 1)]  # then the gather path


class _Launches:
    """``kernels._build`` replaced: records each launch's kernel, template, grid and block
    (the kernels themselves run on CUDA only) and returns zeros of its outputs."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, dict, int, int]] = []
        monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
        monkeypatch.setattr(kernels, "_build", self.build)

    def build(self, name, quantized=False):
        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls.append((name, dict(template), grid[0], threadgroup[0]))
            return [mx.zeros(s, dtype=t) for s, t in zip(output_shapes, output_dtypes, strict=True)]

        return launch

    def run(self, lengths: list[int], h: int = 32, hkv: int = 8, d: int = 128, warps=None):
        page = 16
        width = -(-max(lengths) // page)
        pool = mx.zeros((len(lengths) * width * page, 2 * hkv, d), dtype=mx.bfloat16)
        q = mx.zeros((len(lengths), h, d), dtype=mx.bfloat16)
        tables = mx.zeros((len(lengths), width), dtype=mx.int32)
        work = kernels.DecodeWork(lengths, width)
        out = kernels.paged_decode(
            q, pool, tables, mx.array(lengths), d**-0.5, page, work, warps=warps
        )
        assert out.shape == q.shape
        return work


def test_launch_layouts(monkeypatch):
    """Within one chunk: one query head a block, wide where the launch is small; split:
    blocks of all the query heads of a KV head, then the merge."""
    runs = _Launches(monkeypatch)
    runs.run([384])  # one sequence, 32 blocks
    name, template, grid, block = runs.calls.pop()
    assert (name, template["NW"], template["GQ"]) == ("single", kernels.WIDE_WARPS, 1)
    assert block == 32 * kernels.WIDE_WARPS and grid == 32 * block
    runs.run([384] * 16)  # 512 blocks: narrow
    name, template, grid, block = runs.calls.pop()
    assert (template["NW"], block, grid) == (kernels.WARPS, 32 * kernels.WARPS, 16 * 32 * block)
    work = runs.run([2000, 30])  # 4 + 1 chunks: split, 8 KV heads' blocks an item
    (split, t1, g1, b1), (merge, _, g2, b2) = runs.calls[-2:]
    assert (split, merge, t1["GQ"], t1["NW"]) == ("split", "merge", 4, kernels.WARPS)
    assert work.num_items == 5 and g1 == 5 * 8 * b1 and b1 == 32 * kernels.WARPS
    assert (g2, b2) == (2 * 32 * 128, 128)
    kernels.UNGROUPED.add((32, 8, 128, False, mx.bfloat16))
    kernels.NARROW.add((32, 8, 128, False, mx.bfloat16))
    runs.run([2000, 30])
    assert runs.calls[-2][1]["GQ"] == 1 and runs.calls[-2][2] == 5 * 32 * 32 * kernels.WARPS
    runs.run([384])
    assert runs.calls[-1][1]["NW"] == kernels.WARPS


def test_the_checks_width_reaches_the_kernel_and_the_widths_boundary(monkeypatch):
    runs = _Launches(monkeypatch)
    runs.run([384], warps=kernels.WARPS)  # (the start-up check's narrow run)
    assert runs.calls[-1][1]["NW"] == kernels.WARPS
    runs.run([384] * 16, warps=kernels.WIDE_WARPS)
    assert runs.calls[-1][1]["NW"] == kernels.WIDE_WARPS
    runs.run([384] * 4)  # 128 blocks: wide
    assert runs.calls[-1][1]["NW"] == kernels.WIDE_WARPS
    runs.run([384] * 5)  # 160: narrow
    assert runs.calls[-1][1]["NW"] == kernels.WARPS


def test_off_cuda_one_layout(monkeypatch):
    """Metal (or any backend but CUDA): 4 warps a block, one head, no CUDA-only template
    values, whatever ``warps`` asks; and the check does not run a wide case."""
    runs = _Launches(monkeypatch)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    runs.run([384], warps=kernels.WIDE_WARPS)
    runs.run([2000, 30])
    kernels_run = [c for c in runs.calls if c[0] != "merge"]
    assert [c[0] for c in kernels_run] == ["single", "split"]
    for _, template, _, block in kernels_run:
        assert template["NW"] == kernels.WARPS and block == 32 * kernels.WARPS
        assert "GQ" not in template and "U" not in template
    assert kernels_run[1][2] == 5 * 32 * 32 * kernels.WARPS  # one head a block
    seen = _patched(monkeypatch, lambda layout: True)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert kernel_check._checked_variants(128, 32, 8, mx.bfloat16, None)
    assert [layout for layout in seen if layout[0] == "single"] == [("single", kernels.WARPS)]
