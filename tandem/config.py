"""Engine configuration (frozen)."""

from __future__ import annotations

from dataclasses import dataclass

# --kv-cache-dtype: bits per quantized KV value (None: the model's dtype, unquantized).
KV_CACHE_DTYPES: dict[str, int | None] = {"auto": None, "int8": 8, "int4": 4}
# --speculative: where proposals come from (engine/speculation.py, engine/drafting.py).
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # directory, .gguf file, or None for the default model
    overlap: bool = True
    # Apply a step's results and plan the next beside the submission, on a helper thread
    # (engine/loop.py; None: while the host sets the pace, i.e. finalizes find their step
    # done, on a device apart from the host (a GPU, not the CPU backend); True: whenever a
    # step allows it; False: never, the default: on the H100 it gained nothing, see
    # docs/design.md). Plans and tokens are unchanged; a request arriving then joins one
    # step later.
    host_thread: bool | None = False
    dtype: str = "auto"  # auto: float32 (dequantized) on CPU, as stored on GPUs
    max_num_seqs: int = 256
    max_model_len: int | None = None  # default: the model's own context length
    # Tokens per step, decodes and prefill chunks together (None: 8192 on CUDA, where a
    # step of many new prompts' chunks beats several smaller steps, else 2048).
    max_num_batched_tokens: int | None = None
    # A request's prefill tokens per step (0: up to the whole step budget): a long prompt's
    # chunk attends over its own context, so this bounds that attention's memory (and, with
    # a sliding window's array mask, its square) while the step budget batches many prompts.
    max_prefill_chunk: int = 2048
    prefill_chunk_while_decoding: int = 0  # 0: always the whole max_num_batched_tokens
    # The KV pool, sized once at start: this share of the memory available after loading the
    # weights (None: 0.5, and on the CPU backend at most CPU_KV_BYTES), or kv_budget_tokens.
    kv_memory_fraction: float | None = None
    kv_budget_tokens: int | None = None  # overrides kv_memory_fraction
    kv_page_size: int = 16  # positions per KV page (docs/design.md: why 16)
    # Sliding-window layers keep their pages in a group of their own, freed behind the
    # window while a request runs: its size in pages (None: enough for every sequence's
    # window and two steps of tokens, the rest of the memory to the full-attention pages;
    # 0: no group, those layers keep every position like the others).
    kv_window_pages: int | None = None
    # Two KV buffer sets so a step never writes what the in-flight step reads (None: with
    # overlap on the CPU backend). Costs 2x KV memory; without it MLX may copy whole buffers.
    kv_double_buffer: bool | None = None
    # KV writes by a kernel into the one buffer set (None: where the kernels exist and pass
    # their check, i.e. MLX's CUDA backend without the double buffer; False: MLX scatters).
    kv_inplace_writes: bool | None = None
    # Float pages laid out head by head, (pages, 2 Hkv, page, D), so the gather path reads
    # whole runs of a page (runner/paged.py; None: on the CPU, where it was measured; True:
    # also elsewhere, but never where the decode kernel reads the pages or a kernel writes
    # them in place; False: position by position).
    kv_head_major: bool | None = None
    # Steady decode steps (single-token rows only) of at most this many rows replay an
    # mx.compile trace of the model instead of building its graph in Python
    # (runner/static_decode.py; 0: off, True: any number; None: 64 where KV writes are in
    # place, i.e. CUDA, 4 on the CPU where MLX builds fused kernels, else off); models of
    # paged attention layers (full, sliding windows, chunks) on float pages. On the H100 a
    # step of 16 rows took 1.35x less time compiled (0.6B shape), 1.05x (8B).
    compile_decode: int | None = None
    # One matmul for each layer's q/k/v and for its gate/up projections in steps of at most
    # this many rows (runner/fused_proj.py; 0: off): 4 matmul launches a layer instead of 7;
    # off until measured on a GPU (on the CPU it changes nothing measurable).
    fuse_projections: int = 0
    # The device's paged decode kernel (None: where it exists and passes its self-check;
    # False: the pure-MLX gather path everywhere).
    kv_decode_kernel: bool | None = None
    # KV pages stored as the model's dtype ("auto") or quantized per token ("int8", "int4").
    kv_cache_dtype: str = "auto"
    prefix_cache: bool = True
    # Models with recurrent layers: states the prefix cache keeps (a hit resumes from one;
    # None: 8 x max_num_seqs, at least 64, within a quarter of the KV memory; 0: no prefix
    # cache for them).
    state_snapshots: int | None = None
    # Speculative decoding: None (off), "ngram" (prompt lookup) or "draft" (a smaller model
    # with the same tokenizer, draft_model); K proposed tokens per verify; no speculation
    # once more than speculative_max_batch requests decode (None: 8; 1 for a model with
    # recurrent layers whose verifies cannot share a call: its load check says).
    speculative: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int | None = None
    # Speculation turns itself off for a while when its steps emit fewer tokens per second
    # than this share of plain decoding's at the same batch (engine/spec_gain.py; 0: never).
    speculative_min_gain: float = 1.0
    check_invariants: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_prefill_chunk < 0:
            raise ValueError("max_prefill_chunk must be >= 0")
        if self.prefill_chunk_while_decoding < 0:
            raise ValueError("prefill_chunk_while_decoding must be >= 0")
        if not (self.host_thread is None or isinstance(self.host_thread, bool)):
            raise ValueError("host_thread must be true, false or null (automatic)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError("kv_memory_fraction must be in (0, 1]")
        if self.compile_decode is True:
            object.__setattr__(self, "compile_decode", self.max_num_seqs)
        if self.compile_decode is not None and self.compile_decode < 0:
            raise ValueError("compile_decode must be >= 0")
        if self.fuse_projections < 0:
            raise ValueError("fuse_projections must be >= 0")
        if self.kv_window_pages is not None and self.kv_window_pages < 0:
            raise ValueError("kv_window_pages must be >= 0")
        if self.kv_page_size < 1 or self.kv_page_size & (self.kv_page_size - 1):
            raise ValueError("kv_page_size must be a power of two")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} (or None), got "
                f"{self.speculative!r}; MTP heads are not loaded by mlx-lm yet"
            )
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError(
                "speculative='draft' and draft_model go together "
                "(--speculative draft --draft-model PATH)"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise ValueError("speculative_max_batch must be >= 1")
        if not self.speculative_min_gain >= 0:
            raise ValueError("speculative_min_gain must be >= 0")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError("state_snapshots must be >= 0")
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < self.kv_page_size:
            raise ValueError("kv_budget_tokens must hold at least one page")
