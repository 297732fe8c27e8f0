"""Compose an engine: resolve the model, load weights and tokenizer, size the KV budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.scheduler import SchedulerConfig
from tandem.frontend.tokenizer import Tokenizer
from tandem.model_source import resolve_model

log = logging.getLogger("tandem")


@dataclass
class BuiltEngine:
    engine: Engine
    tokenizer: Tokenizer
    path: Path
    max_model_len: int
    model_type: str


def build_engine(config: EngineConfig) -> BuiltEngine:
    from tandem.runner.kv import ROW_STEP
    from tandem.runner.loader import available_memory_bytes, load_model, prepare_for_device
    from tandem.runner.model_runner import ModelRunner

    path = resolve_model(config.model)
    tokenizer = Tokenizer.load(path)
    model, model_config = load_model(path)
    model_type = str(model_config.get("model_type", ""))
    log.info(
        "model %s (%s), compute dtype: %s",
        path,
        model_type,
        prepare_for_device(model, config.dtype),
    )
    rows = SchedulerConfig(
        max_num_seqs=config.max_num_seqs, prefix_cache=config.prefix_cache
    ).total_rows
    runner = ModelRunner(
        model,
        max_rows=rows,
        model_type=model_type,
        overlap=config.overlap,
        double_buffer=config.kv_double_buffer,
        row_step=ROW_STEP,
    )
    native_len = int(model_config.get("max_position_embeddings") or 4096)
    max_model_len = min(config.max_model_len or native_len, native_len)
    per_token = runner.kv.bytes_per_token
    budget = config.kv_budget_tokens or int(
        available_memory_bytes() * config.kv_memory_fraction // per_token
    )
    budget = min(budget, rows * max_model_len)
    log.info(
        "KV budget %d tokens (%.1f MiB, %d B/token); max_model_len %d",
        budget,
        budget * per_token / 2**20,
        per_token,
        max_model_len,
    )
    sched = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        prefill_chunk_while_decoding=config.prefill_chunk_while_decoding,
        kv_budget_tokens=budget,
        row_chunk=ROW_STEP,
        prefix_cache=config.prefix_cache,
    )
    engine = Engine(
        runner,
        sched,
        eos_token_ids=tokenizer.eos_token_ids,
        overlap=config.overlap,
        check_invariants=config.check_invariants,
        seed=config.seed,
        vocab_size=runner.vocab_size,
        grammar=lambda: GrammarCompiler(tokenizer.hf, runner.vocab_size, tokenizer.eos_token_ids),
    )
    return BuiltEngine(engine, tokenizer, path, max_model_len, model_type)
