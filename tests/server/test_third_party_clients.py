"""What clients nobody on the project wrote send: guidellm's per-chunk usage, lm-eval's remote
tokenizer and prompt scoring (max_tokens 0 with echo), vLLM's tokenizer endpoints."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.frontend.tokenizer import Tokenizer
from tandem.testing.live_server import API_KEY

_llm: dict = {}


def offline(path) -> LLM:
    if "llm" not in _llm:
        _llm["llm"] = LLM(str(path))
    return _llm["llm"]


def post(server, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chunks = []
    with httpx.stream(
        "POST", server.url + path, json={**body, "stream": True}, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_on_every_chunk(server, chat: bool):
    """guidellm always sends stream_options.continuous_usage_stats: usage so far on every
    chunk, counts that only grow, and the final usage chunk agreeing with the last."""
    body: dict = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "count with me"}]
    else:
        body["prompt"] = "one two three"
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    chunks = stream_chunks(server, path, body)
    assert all("usage" in c for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == 12
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 0
    assert chunks[-1]["choices"] == []
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
        for c in chunks
    )
    # Without the option only the final chunk carries usage.
    body["stream_options"] = {"include_usage": True}
    chunks = stream_chunks(server, path, body)
    assert [("usage" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_tokenize_detokenize_and_tokenizer_info(server, served_model):
    tok = Tokenizer.load(served_model)
    text = "hello world, hello tokenizer"
    r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == tok.hf.convert_ids_to_tokens(body["tokens"])
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False)
    assert "token_strs" not in plain

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = post(server, "/tokenize", {"messages": msgs}).json()
    usage = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()[
        "usage"
    ]
    assert chat["count"] == usage["prompt_tokens"]
    assert chat["tokens"] == tok.apply_chat_template(msgs)

    back = post(server, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back["prompt"] == tok.decode(body["tokens"], skip_special_tokens=False)

    info = httpx.get(
        server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()
    assert info["eos_token"] == tok.hf.eos_token
    assert info["vocab_size"] == tok.vocab_size
    assert info["chat_template"] == tok.hf.chat_template
    assert set(info["eos_token_ids"]) == set(tok.eos_token_ids)


def test_tokenizer_endpoints_reject_bad_bodies(server):
    assert_openai_error(post(server, "/tokenize", {"prompt": "x", "nope": 1}), 400)
    assert_openai_error(post(server, "/tokenize", {}), 400)
    assert_openai_error(post(server, "/tokenize", {"messages": []}), 400)
    assert_openai_error(post(server, "/detokenize", {"tokens": [10**9]}), 400, "tokens[0]")
    assert_openai_error(post(server, "/detokenize", {"tokens": "abc"}), 400, "tokens")
    assert_openai_error(post(server, "/tokenize", {"prompt": "x", "model": "other"}), 404)
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x"})  # no API key
    assert_openai_error(r, 401)
    r = httpx.post(
        server.url + "/tokenize",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert_openai_error(r, 400)


def test_max_tokens_zero_with_echo_scores_the_prompt(server, served_model):
    """Prompt scoring as older OpenAI-style scorers ask for it: the prompt's text and
    log-probabilities, no completion, nothing counted as output."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    want = offline(served_model).generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    )[0]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    tok = Tokenizer.load(served_model)
    assert choice["text"] == tok.decode(prompt)
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(prompt) and lps["token_logprobs"][0] is None
    for got, (lp, _) in zip(lps["token_logprobs"][1:], want.prompt_logprobs, strict=True):
        assert math.isclose(got, lp, abs_tol=1e-4)
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert choice["finish_reason"] == "length"

    chunks = stream_chunks(server, "/v1/completions", body)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == choice["text"]

    assert_openai_error(
        post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0}), 400, "max_tokens"
    )
    bad = {"prompt": prompt, "max_tokens": 0, "echo": True, "min_tokens": 1}
    assert_openai_error(post(server, "/v1/completions", bad), 400, "min_tokens")


def test_echo_requests_leave_their_pages_for_others(server):
    """A prompt-logprobs request computes every position (it cannot reuse cached KV), but the
    pages it wrote enter the prefix cache: the same prompt then hits them."""
    prompt = list(range(200, 280))  # five whole pages
    r = post(
        server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 0}
    )
    assert r.status_code == 200
    again = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_lm_eval_loglikelihoods_match_the_offline_api(server, served_model, tmp_path, monkeypatch):
    """lm-evaluation-harness's own client (local-completions): its auto mode finds the remote
    tokenizer, and with a tokenizer folder exported by ``tandem export-tokenizer`` it gets the
    same numbers; both equal the offline API's prompt log-probabilities."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from tandem.cli import main

    tok = Tokenizer.load(served_model)
    pairs = [("hello world", " hello"), ("one two three", " four five"), ("a b", " c")]

    def expected(ctx: str, cont: str) -> float:
        c, whole = tok.encode(ctx), tok.encode(ctx + cont)
        out = offline(served_model).generate(
            [whole], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        )[0]
        return sum(lp for lp, _ in out.prompt_logprobs[len(c) - 1 :])

    want = [expected(*p) for p in pairs]
    folder = tmp_path / "tok"
    assert main(["export-tokenizer", str(folder), "--model", str(served_model)]) == 0
    common = {
        "base_url": server.url + "/v1/completions",
        "model": "tiny",
        "tokenized_requests": True,
        "num_concurrent": 1,
        "max_retries": 1,
        "auth_token": API_KEY,  # the remote tokenizer's key
    }
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # the completions requests' key
    for kwargs in ({}, {"tokenizer_backend": "huggingface", "tokenizer": str(folder)}):
        lm = LocalCompletionsAPI(**common, **kwargs)
        assert lm.tokenizer_backend == kwargs.get("tokenizer_backend", "remote")
        requests = [
            Instance("loglikelihood", {}, (ctx, cont), idx=i) for i, (ctx, cont) in enumerate(pairs)
        ]
        got = [lp for lp, _greedy in lm.loglikelihood(requests, disable_tqdm=True)]
        for g, w in zip(got, want, strict=True):
            assert math.isclose(g, w, abs_tol=1e-4), (got, want)
