"""The offline Python API: ``LLM(model).generate(prompts, params)`` and ``LLM.stream``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tandem.build import build_engine
from tandem.config import EngineConfig
from tandem.frontend.tokenizer import IncrementalDetokenizer
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams, stop_token_set

Prompt = str | list[int]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, str) and not (
            isinstance(p, list) and all(isinstance(t, int) for t in p)
        ):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {p!r:.60}")
    return prompts


class LLM:
    """Runs the engine in this thread. Not thread-safe: one caller at a time. ``close()`` (or
    ``with LLM(...) as llm:``) frees its device memory at once; an engine left to the garbage
    collector may hold it while the next one sizes its KV pool from what is free."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.config = EngineConfig(model=model, **engine_options)
        built = build_engine(self.config)
        self.engine = built.engine
        self.tokenizer = built.tokenizer
        self.max_model_len = built.max_model_len

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Abort what is unfinished and free the KV pools and the model; generating after this
        raises."""
        self.engine.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return list(prompt)

    def chat_prompt(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, **template_kwargs)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError("sampling_params must be one value or one per prompt")
        encoded = [self.encode(p) for p in prompt_list]
        ids: list[str] = []
        try:
            for toks, sp in zip(encoded, params, strict=True):
                ids.append(self.engine.add_request(toks, sp))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            self._run_until_idle()
            raise
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logprobs: dict[str, list] = {rid: [] for rid in ids}
        prompt_lps: dict[str, list] = {rid: [] for rid in ids}
        cached: dict[str, int] = {rid: 0 for rid in ids}
        reasons: dict[str, str] = {}
        while len(reasons) < len(ids):
            for out in self.engine.step():
                if out.request_id in tokens:
                    tokens[out.request_id].extend(out.new_token_ids)
                    logprobs[out.request_id].extend(out.logprobs or ())
                    prompt_lps[out.request_id].extend(out.prompt_logprobs or ())
                    if out.cached_tokens is not None:
                        cached[out.request_id] = out.cached_tokens
                    if out.finish_reason:
                        reasons[out.request_id] = out.finish_reason
        return [
            RequestOutput(
                rid,
                toks,
                tokens[rid],
                self._text(tokens[rid], reasons[rid], sp),
                reasons[rid],
                logprobs[rid] if sp.logprobs is not None else None,
                prompt_lps[rid] if sp.prompt_logprobs is not None else None,
                cached[rid],
            )
            for rid, toks, sp in zip(ids, encoded, params, strict=True)
        ]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the growing output after each step; closing the iterator aborts the request."""
        toks = self.encode(prompt)
        params = sampling_params or SamplingParams()
        rid = self.engine.add_request(toks, params)
        detok = IncrementalDetokenizer(self.tokenizer, toks)
        token_ids: list[int] = []
        text = ""
        finished = False
        cached = 0
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    token_ids.extend(out.new_token_ids)
                    if out.cached_tokens is not None:
                        cached = out.cached_tokens
                    text += detok.add(list(out.new_token_ids))
                    finished = out.finished
                    reason = out.finish_reason
                    if finished:
                        text = self._text(token_ids, reason, params)
                    yield RequestOutput(
                        rid, toks, list(token_ids), text, reason, cached_tokens=cached
                    )
        finally:
            if not finished:
                self.engine.abort(rid)
                self._run_until_idle()

    def _text(self, token_ids: list[int], reason: str | None, params: SamplingParams) -> str:
        # The stop token itself is not part of the text (a completed grammar's last token is).
        stop = stop_token_set(params, self.engine.eos_token_ids)
        ids = (
            token_ids[:-1]
            if reason == "stop" and token_ids and token_ids[-1] in stop
            else token_ids
        )
        return self.tokenizer.decode(ids)

    def _run_until_idle(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()
