"""A live `tandem serve` driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tandem import LLM, SamplingParams
from tandem.frontend.tokenizer import Tokenizer
from tandem.testing.live_server import API_KEY, Server

_offline: dict = {}


def offline(path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    if "llm" not in _offline:
        _offline["llm"] = LLM(str(path))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return _offline["llm"].generate([prompt_ids], sp)[0].token_ids


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "engine_restarts": 0}


def test_completion_matches_offline_engine_and_counts_usage(server, served_model):
    prompt = [5, 6, 7, 8, 9]
    r = client(server).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == offline(served_model, prompt, 12)
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)


def test_streamed_chat_equals_non_streamed_chat(server):
    c = client(server)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    full = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_accept_a_list_of_prompts(server):
    r = client(server).completions.create(
        model="tiny", prompt=["one", "two two"], max_tokens=4, temperature=0
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens <= 8


def test_stop_string_split_across_tokens_is_removed(server, served_model):
    prompt = [100, 7, 9]
    c = client(server)
    base = c.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = base.choices[0].model_extra["token_ids"]
    tok = LLM(str(served_model)).tokenizer if "llm" not in _offline else _offline["llm"].tokenizer
    pieces = [tok.decode([t]) for t in ids]
    # The last character of one clean token and the first of the next: a stop string that
    # can only be seen across a token boundary.
    k = next(
        k
        for k in range(len(ids) - 1)
        if pieces[k]
        and pieces[k + 1]
        and "\ufffd" not in pieces[k] + pieces[k + 1]
        and pieces[k] != pieces[k + 1]
    )
    stop = pieces[k][-1] + pieces[k + 1][0]
    want = base.choices[0].text[: base.choices[0].text.index(stop)]
    for stream in (False, True):
        r = c.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = list(r)
            text = "".join(ch.choices[0].text for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (want, "stop")


def test_64_concurrent_streams_are_token_exact(server, served_model):
    prompts = [[3 + (i * 7 + j) % 300 for j in range(1 + i % 23)] for i in range(64)]

    async def one(ac: openai.AsyncOpenAI, p: list[int], n: int) -> list[int]:
        ids: list[int] = []
        stream = await ac.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for ch in stream:
            ids += ch.choices[0].model_extra.get("token_ids", [])
        return ids

    async def main():
        ac = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        return await asyncio.gather(*(one(ac, p, 4 + i % 13) for i, p in enumerate(prompts)))

    got = asyncio.run(main())
    for i, (p, ids) in enumerate(zip(prompts, got, strict=True)):
        assert ids == offline(served_model, p, 4 + i % 13), i


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "x", "echo": 1}, 400, "echo"),
        ({"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
        ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ({"prompt": "x", "min_p": 2}, 400, "min_p"),
        ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": "x", "max_tokens": 3, "min_tokens": 5}, 400, "min_tokens"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ],
)
def test_bad_completion_requests_get_openai_errors(server, body, status, param):
    r = server.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_logit_bias_and_min_tokens_over_http(server):
    c = client(server)
    forced = c.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=6,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True, "return_token_ids": True, "min_p": 0.1},
    )
    assert forced.choices[0].model_extra["token_ids"] == [42] * 6
    # A strong frequency penalty stops the forced token from repeating forever.
    freed = c.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=6,
        temperature=0,
        logit_bias={"42": 3},
        frequency_penalty=2,
        extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.2},
    )
    assert freed.choices[0].model_extra["token_ids"].count(42) < 6
    r = server.post("/v1/completions", json={"prompt": "x", "logit_bias": {str(10**7): 1}})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


def test_n_returns_n_choices_streaming_and_not(server):
    c = client(server)
    r = c.completions.create(
        model="tiny",
        prompt=[5, 6, 7, 8],
        max_tokens=8,
        temperature=1.0,
        seed=11,
        n=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    ids = [tuple(ch.model_extra["token_ids"]) for ch in r.choices]
    assert len(set(ids)) > 1
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 24
    # Sample j draws with seed + j: the same as n = 1 with that seed.
    one = c.completions.create(
        model="tiny",
        prompt=[5, 6, 7, 8],
        max_tokens=8,
        temperature=1.0,
        seed=12,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert tuple(one.choices[0].model_extra["token_ids"]) == ids[1]
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            n=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    finished = {ch.index for chunk in chunks for ch in chunk.choices if ch.finish_reason}
    assert finished == {0, 1}
    bad = server.post("/v1/completions", json={"prompt": "x", "n": 17})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


def test_logprobs_in_openai_shapes_streaming_and_not(server, served_model):
    c = client(server)
    r = c.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    lp = r.choices[0].logprobs
    ids = r.choices[0].model_extra["token_ids"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)  # keys never coincide
    # Greedy: each chosen token is the most likely one.
    assert all(
        max(t.values()) == pytest.approx(v)
        for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    offline_lps = LLM(str(served_model)).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    )[0]
    assert offline_lps.token_ids == ids
    assert lp.token_logprobs == pytest.approx([v for v, _ in offline_lps.logprobs], abs=1e-5)
    msgs = [{"role": "user", "content": "hello"}]
    full = c.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = full.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    stream = c.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        e
        for ch in stream
        for choice in ch.choices
        if choice.logprobs
        for e in choice.logprobs.content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    bad = server.post("/v1/chat/completions", json={"messages": msgs, "top_logprobs": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


def test_echo_and_prompt_logprobs(server, served_model):
    c = client(server)
    prompt = [5, 6, 7, 8, 9]
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    r = c.completions.create(echo=True, extra_body={"ignore_eos": True}, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    offline = LLM(str(served_model)).generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    )[0]
    want = [v for v, _ in offline.prompt_logprobs]
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=1e-5)
    plain = c.completions.create(extra_body={"ignore_eos": True}, **kw)
    prompt_text = r.choices[0].text[: len(r.choices[0].text) - len(plain.choices[0].text)]
    assert r.choices[0].text == prompt_text + plain.choices[0].text and prompt_text
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            echo=True, stream=True, extra_body={"ignore_eos": True}, **kw
        )
        if ch.choices
    )
    assert streamed == r.choices[0].text
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 1, "ignore_eos": True},
    )
    plp = chat.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 1 for e in plp[1:])


def test_best_of_returns_the_most_likely_samples(server, served_model):
    c = client(server)
    prompt = [5, 6, 7]
    r = c.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=1.0,
        seed=40,
        n=2,
        best_of=4,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    got = [tuple(ch.model_extra["token_ids"]) for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1] and r.choices[0].logprobs is None
    llm = LLM(str(served_model))
    samples = llm.generate(
        [prompt] * 4,
        [
            SamplingParams(max_tokens=6, temperature=1.0, seed=40 + j, ignore_eos=True, logprobs=0)
            for j in range(4)
        ],
    )
    ranked = sorted(samples, key=lambda o: -sum(v for v, _ in o.logprobs))
    assert got == [tuple(o.token_ids) for o in ranked[:2]]
    assert r.usage.completion_tokens == 24  # every sample counts
    bad = server.post("/v1/completions", json={"prompt": "x", "n": 3, "best_of": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of"


def test_context_overflow_names_both_numbers(server):
    r = server.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 4000})
    assert r.status_code == 400
    assert "100" in r.json()["error"]["message"] and "4000" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
    ],
)
def test_bad_chat_requests_get_400(server, body, param):
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_malformed_json_oversized_body_and_auth(server):
    r = server.post(
        "/v1/completions",
        content=b"{not json",
        headers={**server.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 400
    r = server.post("/v1/completions", content=b"x" * (5 << 20), headers=server.headers())
    assert r.status_code == 413
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").models.list()


def metric(server, name: str) -> float:
    return server.metric(name)


def test_disconnect_aborts_and_frees_kv(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers=server.headers(),
        json={"prompt": "a", "max_tokens": 3000, "stream": True, "ignore_eos": True},
        timeout=30,
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    server.wait_idle(10)
    assert metric(server, "tandem_num_requests_running") == 0
    assert metric(server, "tandem_kv_cache_usage_ratio") == 0


def test_non_streaming_disconnect_aborts_too(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            headers=server.headers(),
            timeout=1.0,
            json={"prompt": "a", "max_tokens": 3000, "ignore_eos": True},
        )
    server.wait_idle(10)
    assert metric(server, "tandem_num_requests_running") == 0, "".join(server.log[-60:])


def test_repeated_prompt_reports_cached_tokens(server):
    c = client(server)
    messages = [{"role": "user", "content": "tell me about the prefix cache " * 8}]
    first = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    second = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    # Earlier chats may share the template's opening tokens, never the whole prompt.
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2
    # Every whole KV page (16 tokens) before the last prompt token comes from the cache; the
    # partial last page is recomputed. The output is the same.
    assert second.usage.prompt_tokens_details.cached_tokens == (
        (second.usage.prompt_tokens - 1) // 16 * 16
    )
    assert second.choices[0].message.content == first.choices[0].message.content
    stream = c.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    assert 0 < metric(server, "tandem_prefix_cache_hit_rate") <= 1


def test_metrics_count_tokens(server):
    # (Its own request: run alone, or first on its worker, nothing else has sent one.)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert server.post("/v1/completions", json=body).status_code == 200
    text = server.get("/metrics").text
    assert "tandem_generation_tokens_total" in text
    assert "tandem_time_to_first_token_seconds_bucket" in text
    assert metric(server, "tandem_prompt_tokens_total") > 0


def test_pause_holds_requests_and_resume_finishes_them(server):
    assert server.post("/pause").status_code == 200
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=60)

    async def later():
        await asyncio.sleep(1.0)
        server.post("/resume")

    async def main():
        task = asyncio.create_task(later())
        t0 = time.time()
        r = await asyncio.to_thread(
            c.completions.create,
            model="tiny",
            prompt="hi",
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        await task
        return r, time.time() - t0

    r, elapsed = asyncio.run(main())
    assert r.usage.completion_tokens == 3 and elapsed >= 0.9


def test_sigterm_drains_in_flight_requests_and_exits_zero(served_model):
    s = Server(served_model, api_key=None)
    with httpx.stream(
        "POST",
        s.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True},
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        next(lines)
        s.proc.send_signal(15)
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(60) == 0


def test_engine_death_fails_requests_and_restarts_it_then_exits_after_the_last_retry(
    served_model,
):
    import os
    import signal
    import time

    from tandem.frontend.engine_client import MAX_RESTARTS

    s = Server(served_model, api_key=None)
    with httpx.stream(
        "POST",
        s.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True},
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(s.engine_pid(), signal.SIGKILL)
        rest = list(lines)
    assert any("error" in ln for ln in rest)
    for restart in range(1, MAX_RESTARTS + 1):
        deadline = time.monotonic() + 120
        while s.get("/health").json() != {"status": "ok", "engine_restarts": restart}:
            assert time.monotonic() < deadline, "the engine was not restarted"
            time.sleep(0.2)
        if restart < MAX_RESTARTS:
            os.kill(s.engine_pid(), signal.SIGKILL)
    os.kill(s.engine_pid(), signal.SIGKILL)  # one death more than the server retries
    assert s.proc.wait(60) != 0


def test_engine_killed_while_loading_exits_nonzero_with_a_reason(served_model):
    """The engine process dies before it is ready: `tandem serve` says so and exits non-zero
    (no hang waiting for a ready message that never comes)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            "--model",
            str(served_model),
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 60
        killed = False
        while time.time() < deadline and not killed:
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            for pid in kids:
                if b"multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
                    killed = True
            time.sleep(0.01)
        assert killed, "no engine process appeared"
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode not in (0, None)
    assert "engine process exited" in out and "tandem: serving" not in out


def test_overload_gives_503(served_model):
    s = Server(served_model, "--max-pending", "2", api_key=None)
    try:

        async def main():
            async with httpx.AsyncClient(timeout=60) as ac:
                body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
                rs = await asyncio.gather(
                    *(ac.post(s.url + "/v1/completions", json=body) for _ in range(6))
                )
                return [r.status_code for r in rs]

        codes = asyncio.run(main())
        assert codes.count(200) >= 2 and 503 in codes
    finally:
        assert s.stop() == 0


def test_returned_assistant_message_can_be_sent_back_and_template_is_not_replaceable(server):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "thought", "refusal": None},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}
            ],
        },
        {"role": "user", "content": "again"},
    ]
    r = server.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    for key in ("chat_template", "add_generation_prompt", "tools"):
        body = {"messages": msgs[:1], "max_tokens": 2, "chat_template_kwargs": {key: "x"}}
        r = server.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    r = server.post(
        "/tokenize",
        json={"messages": msgs[:1], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
    )
    assert r.status_code == 400


def test_the_text_is_every_token_decoded_even_when_it_ends_inside_a_character(server, served_model):
    """Outputs cut at every length: the text (whole and streamed) is what decoding its
    token ids gives, a trailing U+FFFD included (the bytes of a character max_tokens cut,
    which the streaming detokenizer holds back until the end)."""
    c = client(server)
    tok = Tokenizer.load(served_model)
    cut = 0
    for n in range(1, 25):
        kw = dict(model="tiny", prompt=[101, 7, 9], max_tokens=n, temperature=0)
        kw["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
        whole = c.completions.create(**kw).choices[0]
        want = tok.decode(whole.model_extra["token_ids"])
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True))
        assert whole.text == streamed == want, n
        cut += want.endswith("\ufffd")
    assert cut, "no output length ended inside a character: the test shows nothing"
