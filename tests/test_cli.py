"""The `tandem` command and model resolution errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.model_source import ModelSourceError, resolve_model


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_the_offline_engines_completion(tiny_model_dir):
    from tandem import LLM, SamplingParams

    path = tiny_model_dir("qwen2")
    r = tandem(
        "generate", "--model", str(path), "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos"
    )
    assert r.returncode == 0, r.stderr
    want = (
        LLM(str(path))
        .generate("Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        .text
    )
    assert r.stdout == want + "\n"


def test_generate_with_a_wrong_path_names_it_and_fails(tmp_path):
    r = tandem("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2 and "nope" in r.stderr and "does not exist" in r.stderr


def test_serve_reports_why_the_engine_could_not_load(tiny_model_dir, tmp_path):
    """A failure inside the engine process at load (here: a draft model that is not there)
    reaches the terminal with its reason, not only an exit code."""
    path = str(tiny_model_dir("llama"))
    missing = str(tmp_path / "no-draft")
    r = tandem("serve", "--model", path, "--port", "0", "--speculative", "draft",
               "--draft-model", missing)  # fmt: skip
    assert r.returncode != 0
    assert "engine failed to start" in r.stderr and "no-draft" in r.stderr, r.stderr


def test_model_source_errors_name_the_path(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(tmp_path)
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="weights.bin"):
        resolve_model(bad)


def test_served_model_name_defaults():
    from pathlib import Path

    from tandem.server.serve import default_served_name

    assert default_served_name(None, Path("/c/SmolLM2-135M-Instruct.Q4_1.gguf")) == (
        "SmolLM2-135M-Instruct"
    )
    assert default_served_name("/m/qwen.gguf", Path("/m/qwen.gguf")) == "qwen"
    assert default_served_name("/m/dir", Path("/m/dir")) == "dir"


def test_host_thread_is_off_unless_asked():
    """The loop's helper thread measured no end-to-end gain on the H100 (docs/design.md):
    off by default in the offline API, the engine and `tandem serve`; auto and on parse."""
    from tandem.cli import _engine_config, build_parser
    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.engine.loop import OverlapLoop

    assert EngineConfig().host_thread is False
    assert OverlapLoop.__init__.__kwdefaults__["host_thread"] is False
    assert Engine.__init__.__kwdefaults__["host_thread"] is False
    parse = build_parser().parse_args
    assert _engine_config(parse(["serve"])).host_thread is False
    assert _engine_config(parse(["serve", "--host-thread", "auto"])).host_thread is None
    assert _engine_config(parse(["serve", "--host-thread", "on"])).host_thread is True


def test_step_budget_defaults_by_device_and_the_chunk_cap_parses():
    """Tokens per step: 8192 on CUDA, 2048 elsewhere unless set; a dense model's context
    still caps it; one request's chunk is 2048 unless set."""
    from types import SimpleNamespace

    from tandem.build import _step_tokens
    from tandem.cli import _engine_config, build_parser
    from tandem.config import EngineConfig

    parse = build_parser().parse_args
    config = _engine_config(parse(["serve"]))
    assert config.max_num_batched_tokens is None and config.max_prefill_chunk == 2048
    set_ = _engine_config(parse(["serve", "--max-num-batched-tokens", "512"]))
    assert set_.max_num_batched_tokens == 512
    assert _engine_config(parse(["serve", "--max-prefill-chunk", "0"])).max_prefill_chunk == 0
    gpu = SimpleNamespace(cuda=True, dense=False)
    cpu = SimpleNamespace(cuda=False, dense=False)
    assert _step_tokens(gpu, config, 4096, 16) == 8192
    assert _step_tokens(cpu, config, 4096, 16) == 2048
    assert _step_tokens(gpu, set_, 4096, 16) == 512
    dense = SimpleNamespace(cuda=True, dense=True, dense_bytes_per_token=1024)
    assert _step_tokens(dense, config, 4096, 16) == (512 << 20) // (4096 * 1024) == 128
    for bad in ({"max_num_batched_tokens": 0}, {"max_prefill_chunk": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
