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


def test_grouping_where_registers_and_shared_memory_allow():
    assert kernels.grouped(32, 8, 128) == 4  # Qwen3-8B
    assert kernels.grouped(64, 8, 128) == 8
    assert kernels.grouped(40, 8, 128) == 5
    assert kernels.grouped(16, 16, 128) == 1  # no KV head shared
    assert kernels.grouped(16, 2, 256) == 1  # 8 heads x 8 values a lane: too many registers
    assert kernels.grouped(128, 8, 128) == 1  # 16 heads x 4 values a lane: too many


def _patched(monkeypatch, agrees):
    """``_check_case`` replaced: ``agrees(grouped, split)`` decides; returns the calls
    (query heads a split block serves, or 0 for the single variant)."""
    seen: list[int] = []

    def case(d, h, hkv, dtype, lengths, quant):
        split = max(lengths) > kernel_check.CHUNK
        g = kernels.grouped(h, hkv, d, quant is not None, dtype) if split else 0
        seen.append(g)
        return agrees(g, split)

    monkeypatch.setattr(kernel_check, "_check_case", case)
    return seen


def test_a_failing_grouped_split_is_checked_again_one_head_a_block(monkeypatch):
    seen = _patched(monkeypatch, lambda g, split: g <= 1)
    assert kernel_check._checked_variants(128, 32, 8, mx.bfloat16, None)
    assert seen == [0, 4, 1]  # single, grouped split, split one head a block
    assert kernels.grouped(32, 8, 128) == 1
    assert kernels.grouped(32, 8, 128, quantized=True) == 4  # (each checked on its own)
    assert kernels.grouped(32, 8, 128, dtype=mx.float16) == 4


def test_a_failing_single_variant_gives_the_kernel_up_without_a_retry(monkeypatch):
    seen = _patched(monkeypatch, lambda g, split: split)
    assert not kernel_check._checked_variants(128, 32, 8, mx.bfloat16, None)
    assert seen == [0] and not kernels.UNGROUPED


def test_a_failure_without_grouping_gives_the_kernel_up(monkeypatch):
    seen: list[int] = []

    def fails(d, h, hkv, dtype, lengths, quant):
        seen.append(kernels.grouped(h, hkv, d) if max(lengths) > kernel_check.CHUNK else 0)
        if seen[-1]:
            raise RuntimeError("the kernel did not compile")
        return True

    monkeypatch.setattr(kernel_check, "_check_case", fails)
    assert not kernel_check._checked_variants(128, 16, 16, mx.bfloat16, None)
    assert seen == [0, 1]
    seen.clear()
    assert not kernel_check._checked_variants(128, 32, 8, mx.bfloat16, None)
    assert seen == [0, 4, 1]  # grouped, then one head a block, then the gather path
