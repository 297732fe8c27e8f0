"""Compose an engine: resolve the model, load weights and tokenizer, size the KV budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.config import EngineConfig
from tandem.engine import recovery
from tandem.engine.engine import Engine
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.kv_manager import min_window_pages
from tandem.engine.scheduler import SchedulerConfig
from tandem.engine.speculation import SpecConfig
from tandem.frontend.tokenizer import Tokenizer
from tandem.model_source import resolve_model

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner

log = logging.getLogger("tandem")

# Per dense layer (runner/layers.py), the gathered history of one step's tokens at full
# context may take this much: it caps such a model's tokens per step.
DENSE_GATHER_BYTES = 512 << 20
# Default tokens per step: on an H100 a B = 256 ramp of 256-token prompts took 8 steps and
# 0.39 s at 8192 against 34 steps and 0.63 s at 2048 (docs/benchmarks.md). Elsewhere (the
# CPU, Metal: not measured) 2048, mlx-lm's prefill step: a step's prefill there is compute
# that a larger step only makes the decoding streams wait for longer.
CUDA_STEP_TOKENS = 8192
STEP_TOKENS = 2048


@dataclass
class BuiltEngine:
    engine: Engine
    tokenizer: Tokenizer
    path: Path
    max_model_len: int
    model_type: str


def build_engine(config: EngineConfig) -> BuiltEngine:
    from tandem.runner.kv_quant import KVQuant
    from tandem.runner.loader import kv_memory_bytes, load_model, prepare_for_device
    from tandem.runner.model_runner import ModelRunner

    path = resolve_model(config.model)
    tokenizer = Tokenizer.load(path)
    model, model_config = load_model(path, config.dtype)
    model_type = str(model_config.get("model_type", ""))
    log.info(
        "model %s (%s), compute dtype: %s",
        path,
        model_type,
        prepare_for_device(model, config.dtype),
    )
    runner = ModelRunner(
        model,
        model_type=model_type,
        overlap=config.overlap,
        double_buffer=config.kv_double_buffer,
        decode_kernel=config.kv_decode_kernel,
        kv_quant=KVQuant.parse(config.kv_cache_dtype),
        inplace_writes=config.kv_inplace_writes,
        compile_decode=config.compile_decode,
        fuse_projections=config.fuse_projections,
        head_major=config.kv_head_major,
    )
    native_len = int(model_config.get("max_position_embeddings") or 4096)
    max_model_len = min(config.max_model_len or native_len, native_len)
    speculation = _speculation(config, runner)
    draft = _draft_runner(config, tokenizer, max_model_len) if config.draft_model else None
    # The draft's pool has as many pages as the target's (engine/drafting.py).
    per_token = runner.bytes_per_token + (draft.bytes_per_token if draft else 0)
    state_slots = config.max_num_seqs if runner.recurrent else 0
    memory = kv_memory_bytes(config.kv_memory_fraction)
    snapshots = 0
    if state_slots and config.prefix_cache:
        # Snapshot slots of states for the prefix cache, unless set: a multi-turn chat keeps
        # up to two states per turn (its prompt's last page boundary and its end), and more
        # conversations stay alive than run at once (their users are typing), so 8 per
        # running sequence (at least 64), in at most a quarter of the KV memory. With 2 per
        # sequence, 8 conversations of 4 turns on the H200 reused 0-5% of their prompts;
        # with 64 slots 17/55/69% (docs/benchmarks.md, "Multi-turn").
        snapshots = config.state_snapshots
        if snapshots is None:
            cap = int(memory // 4 // runner.state_bytes_per_seq)
            snapshots = min(max(8 * config.max_num_seqs, 64), cap)
    # More than every sequence at full length (twice, with the prefix cache) is unused; a
    # recurrent model has a prefix cache only with snapshot slots.
    cached = config.prefix_cache and (snapshots > 0 or not state_slots)
    backups = 0
    if state_slots and speculation.enabled:
        # Each verify keeps the state it starts from in a snapshot slot, to replay from when
        # a proposal is rejected (engine/results.py): at most max_batch verifies at once,
        # and as many rolled-back requests until their replays launch. Shared with the
        # prefix cache's snapshots (none without it). (Kept per position instead, a
        # verify's states take ids of no pool memory: state_positions below.)
        backups = 2 * speculation.max_batch
    seqs = config.max_num_seqs * (2 if cached else 1)
    page = config.kv_page_size
    step_tokens = _step_tokens(runner, config, max_model_len, page)
    window = runner.max_window
    # (No request reaches past a window as long as the context: nothing to free.)
    window_pages = _window_pages(config, window, page, step_tokens) if window < max_model_len else 0
    states = state_slots + snapshots + backups
    memory -= states * runner.state_bytes_per_seq  # the states first
    if state_slots and speculation.per_position:
        # Verifies' states per position, held outside the pool (runner/state.py): a step's
        # K per speculating request, and those its requests resume from, during the next.
        memory -= 2 * speculation.num_tokens * speculation.max_batch * runner.state_bytes_per_seq
    if (
        state_slots
        and per_token
        and not config.kv_budget_tokens
        and memory < per_token * max_model_len
    ):
        raise ValueError(
            f"{states} recurrent states of {runner.state_bytes_per_seq} "
            "bytes leave no memory for KV: lower --max-num-seqs (or --state-snapshots)"
        )

    def full_pages(wbytes: int) -> int:
        """Pages of the full-attention layers, next to ``window_pages`` of ``wbytes``."""
        if config.kv_budget_tokens:
            budget = config.kv_budget_tokens
        elif per_token == wbytes:  # no full-attention KV: pages only count positions
            budget = seqs * max_model_len
        else:
            rest = max(0, memory - window_pages * page * wbytes)
            budget = min(int(rest // (per_token - wbytes)), seqs * max_model_len)
        return max(1, budget // page)

    wbytes = runner.window_bytes_per_token() if window_pages else 0
    if window_pages and not config.kv_budget_tokens:
        share = 1 if per_token == wbytes else 2  # (only windowed layers: all of it)
        window_pages = _fit_window_group(config, window_pages, window, page, wbytes, memory, share)
    num_pages = full_pages(wbytes)
    if window_pages and config.kv_window_pages is None and window_pages >= num_pages:
        log.info(
            "sliding-window layers: a group of their own would need %d pages, no fewer than "
            "the %d of the others: one group for all (lower --max-num-seqs, or set "
            "--kv-window-pages, to free their pages behind the window)",
            window_pages,
            num_pages,
        )
        window_pages = wbytes = 0
        num_pages = full_pages(0)
    runner.allocate_kv(num_pages, page, states, window_pages)
    # (The load check may have turned batched verifies or per-position states off.)
    speculation = _speculation(config, runner)
    proposer = None
    if draft is not None:
        from tandem.runner.draft import DraftModel

        draft.allocate_kv(num_pages, page)
        proposer = DraftModel(
            draft, runner.vocab_size, _step_tokens(draft, config, max_model_len, page)
        )
        runner.draft = proposer  # most proposals ride the target's steps
        log.info(
            "draft model %s (%s): %d B/token of KV in the same pages",
            config.draft_model,
            draft.model_type,
            draft.bytes_per_token,
        )
    if state_slots:
        log.info(
            "recurrent states: %d running + %d cached + %d for verifies (%.1f MiB each)",
            state_slots,
            snapshots,
            backups,
            runner.state_bytes_per_seq / 2**20,
        )
    if state_slots and speculation.per_position:
        log.info(
            "speculative verifies keep their states per position (no replays): up to %d "
            "held outside the pool",
            2 * speculation.num_tokens * speculation.max_batch,
        )
    log.info(
        "KV pool %d pages of %d tokens (%.1f MiB, %d B/token, %s); max_model_len %d",
        num_pages,
        page,
        (num_pages * (per_token - wbytes) + window_pages * wbytes) * page / 2**20,
        per_token,
        runner.kv_description,
        max_model_len,
    )
    if window_pages:
        log.info(
            "sliding-window layers (window %d): %d pages of their own (%d of the B/token), "
            "freed behind the window",
            window,
            window_pages,
            wbytes,
        )
    sched = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=step_tokens,
        max_prefill_chunk=config.max_prefill_chunk,
        prefill_chunk_while_decoding=config.prefill_chunk_while_decoding,
        kv_budget_tokens=num_pages * page,
        page_size=page,
        # A recurrent model's hits resume from state snapshots (none: no prefix cache).
        prefix_cache=cached,
        state_slots=state_slots,
        state_snapshots=snapshots + backups,
        speculation=speculation,
        # Each speculating request's K states and the one it resumes from (no memory).
        state_positions=(speculation.num_tokens + 1) * speculation.max_batch
        if speculation.per_position
        else 0,
        window=window if window_pages else 0,
        window_pages=window_pages,
    )
    engine = Engine(
        runner,
        sched,
        eos_token_ids=tokenizer.eos_token_ids,
        overlap=config.overlap,
        host_thread=config.host_thread,
        check_invariants=config.check_invariants,
        seed=config.seed,
        vocab_size=runner.vocab_size,
        grammar=lambda: GrammarCompiler(tokenizer.hf, runner.vocab_size, tokenizer.eos_token_ids),
        proposer=proposer,
    )
    log.info(
        "steps of up to %d tokens, a request's prefill chunk up to %d",
        step_tokens,
        recovery.prefill_cap(engine.scheduler),
    )
    return BuiltEngine(engine, tokenizer, path, max_model_len, model_type)


def _fit_window_group(
    config: EngineConfig,
    window_pages: int,
    window: int,
    page: int,
    wbytes: int,
    memory: int,
    share: int,
) -> int:
    """The window group within the KV memory: an automatic one in at most 1 / ``share`` of
    it (its chunks and decodes wait or retract when it runs short), a set one in all."""
    per_page = page * wbytes
    if config.kv_window_pages is None:
        least = min_window_pages(window, page)
        window_pages = min(window_pages, max(least, memory // share // per_page))
    if window_pages * per_page > memory:
        raise ValueError(
            f"{window_pages} pages of the sliding-window layers take "
            f"{window_pages * per_page / 2**20:.0f} MiB, more than the "
            f"{memory / 2**20:.0f} MiB of KV memory: lower --kv-window-pages"
        )
    return window_pages


def _window_pages(config: EngineConfig, window: int, page: int, step_tokens: int) -> int:
    """Pages of the sliding-window layers' group: as set, else enough that every sequence
    holds its window (its pages behind it are freed a step late) while two steps' tokens
    are written, so their pages never run short; 0 without windowed layers."""
    if not window or config.kv_window_pages == 0:
        return 0
    if config.kv_window_pages is not None:
        return config.kv_window_pages
    per_seq = -(-window // page) + 3
    return config.max_num_seqs * per_seq + 2 * -(-step_tokens // page)


def _step_tokens(runner, config: EngineConfig, max_model_len: int, page: int) -> int:
    """Tokens per step (as set, else CUDA's or the others' default); dense layers gather each
    token's history, so for a model with them tokens x context per layer is bounded."""
    step_tokens = config.max_num_batched_tokens
    if step_tokens is None:
        step_tokens = CUDA_STEP_TOKENS if runner.cuda else STEP_TOKENS
    if runner.dense:
        cap = max(page, DENSE_GATHER_BYTES // (max_model_len * runner.dense_bytes_per_token))
        if cap < step_tokens:
            log.info("dense attention layers: %d tokens per step (was %d)", cap, step_tokens)
            step_tokens = cap
    return step_tokens


def _draft_runner(config: EngineConfig, tokenizer: Tokenizer, max_model_len: int):
    """The draft model's runner (pool not allocated yet), after checking that it shares the
    target's tokenizer (its token ids must mean the same text), embeds every id of it, and
    reaches the target's context length."""
    from tandem.runner.kv_quant import KVQuant
    from tandem.runner.loader import load_model, prepare_for_device
    from tandem.runner.model_runner import ModelRunner

    assert config.draft_model is not None
    path = resolve_model(config.draft_model)
    theirs = Tokenizer.load(path).hf.get_vocab()
    ours = tokenizer.hf.get_vocab()
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise ValueError(
            f"draft model {config.draft_model} has another tokenizer than the target "
            f"({len(theirs)} vs {len(ours)} tokens, {differ} entries differ): speculative "
            "decoding needs the same token ids"
        )
    model, model_config = load_model(path, config.dtype)
    prepare_for_device(model, config.dtype)
    model_type = str(model_config.get("model_type", ""))
    native = int(model_config.get("max_position_embeddings") or max_model_len)
    if native < max_model_len:
        raise ValueError(
            f"draft model {config.draft_model} has a context of {native} tokens, less than "
            f"the target's {max_model_len}: use a draft with a longer context or lower "
            "--max-model-len"
        )
    runner = ModelRunner(
        model,
        model_type=model_type,
        overlap=False,  # nothing of the draft's is in flight across steps
        double_buffer=False,
        decode_kernel=config.kv_decode_kernel,
        kv_quant=KVQuant.parse(config.kv_cache_dtype),
        inplace_writes=config.kv_inplace_writes,
        # Its proposals after the first are steps of single-token rows, as a steady decode's:
        # compiled where the target's would be (runner/static_decode.py).
        compile_decode=config.compile_decode,
        fuse_projections=config.fuse_projections,
        head_major=config.kv_head_major,
    )
    if runner.recurrent:
        raise ValueError(
            f"draft model {config.draft_model} ({model_type}) has recurrent layers, whose "
            "state cannot be rolled back past rejected proposals: use an attention-only draft"
        )
    if runner.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"draft model {config.draft_model} scores {runner.vocab_size} tokens, fewer than "
            f"its tokenizer's {tokenizer.vocab_size}"
        )
    return runner


def _speculation(config: EngineConfig, runner: ModelRunner) -> SpecConfig:
    if config.speculative is None:
        return SpecConfig()
    max_batch = config.speculative_max_batch
    if max_batch is None:
        # With recurrent layers verifies of one length run as one (B, K + 1) call; where
        # the load check found that layout wrong (``batch_sequences``), each speculating
        # request is a call of its own, which costs more than it gives beside other
        # decodes (docs/benchmarks.md).
        max_batch = 1 if runner.recurrent and not runner.batch_sequences else 8
    return SpecConfig(
        num_tokens=config.num_speculative_tokens,
        max_batch=max_batch,
        min_gain=config.speculative_min_gain,
        draft=config.speculative == "draft",
        per_position=runner.recurrent and runner.state_positions,
    )
