"""The playground and the dashboard in a real browser: headless Chromium (Debian's package,
driven by Playwright's Python API) against a live server on the tiny model, with an API key
set, so every page has to ask for it.

The random-weight model writes noise, so what the tests check is what the page does with it:
streamed text appearing in pieces, a stop that ends the request on the server, a JSON-schema
answer (the grammar makes it valid) rendered as JSON, a forced tool call shown as a card, a
think block folded away, the copied curl and Python requests working, and the dashboard's
charts moving while a load runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import pytest

from tandem.testing.browser import find_chromium
from tandem.testing.live_server import API_KEY, Server

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
)
CHROMIUM = find_chromium()
if CHROMIUM is None:
    pytest.skip(
        "no Chromium executable (apt-get install chromium, or set TANDEM_CHROMIUM)",
        allow_module_level=True,
    )

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
THINK = r"start: /<think>[a-z ]{3,20}<\/think>\n\nanswer: (yes|no)/"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def server(served_model):
    s = Server(served_model, "--tool-call-format", "hermes", "--reasoning", "off")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """A fresh page (its own storage) on the playground, past the API key prompt."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.url + "/")
    pg.wait_for_selector("#key-dialog[open]")  # /v1/models answered 401: the page asks
    pg.fill("#key-input", API_KEY)
    pg.click("#key-save")
    pg.wait_for_function("document.getElementById('model-name').textContent.includes('tiny')")
    yield pg
    context.close()
    assert not errors, errors


def set_extra(pg, fields: dict) -> None:
    """The extra-body field, under its folded "More request fields"."""
    pg.locator("#settings details").evaluate("d => { d.open = true; }")
    pg.fill("#extra", json.dumps(fields))


def send(pg, text: str) -> None:
    n = pg.locator(".msg.assistant").count()
    pg.fill("#prompt", text)
    pg.click("#send")
    pg.wait_for_selector(f".msg.assistant >> nth={n}")


def last_turn(pg, timeout: int = TIMEOUT_MS):
    """The newest assistant turn, once it finished."""
    turn = pg.locator(".msg.assistant").last
    turn.and_(pg.locator("[data-finish]")).wait_for(timeout=timeout)
    return turn


def test_chat_streams_and_reports_tokens_per_turn(page):
    page.fill("#max-tokens", "48")
    set_extra(page, {"ignore_eos": True})
    # Count the assistant text's changes: streamed output arrives in many of them.
    page.evaluate(
        """() => { window.textChanges = 0;
          new MutationObserver(() => window.textChanges++).observe(
            document.getElementById('messages'),
            {subtree: true, childList: true, characterData: true}); }"""
    )
    send(page, "Hello there, tell me a story about a cat.")
    turn = last_turn(page)
    assert turn.get_attribute("data-finish") == "length"
    assert turn.locator(".content").inner_text().strip()
    assert page.evaluate("window.textChanges") > 10
    usage = turn.locator(".usage")
    assert usage.get_attribute("data-completion") == "48"
    assert usage.get_attribute("data-cached") == "0"
    assert "48 completion tokens" in usage.inner_text()
    # The second turn resends the first: its prompt is served from the prefix cache.
    send(page, "And then?")
    usage = last_turn(page).locator(".usage")
    assert int(usage.get_attribute("data-cached")) >= 16
    assert int(usage.get_attribute("data-prompt")) > 48
    assert page.locator(".msg.user").count() == 2


def test_stop_ends_the_stream_and_the_request(page, server):
    page.fill("#max-tokens", "3000")
    set_extra(page, {"ignore_eos": True})
    send(page, "Write forever.")
    turn = page.locator(".msg.assistant").last
    page.wait_for_function(
        "document.querySelector('.msg.assistant .content').textContent.length > 20"
    )
    assert page.locator("#stop").is_visible() and not page.locator("#send").is_visible()
    page.click("#stop")
    turn = last_turn(page)
    assert turn.get_attribute("data-finish") == "stopped"
    assert page.locator("#send").is_visible()
    assert "stopped" in turn.locator(".usage").inner_text()
    # The server aborted it: nothing runs on (3,000 tokens would take a while).
    server.wait_idle(20)
    assert server.metric("tandem_num_requests_running") == 0


def test_json_schema_answer_is_rendered_as_json(page):
    page.select_option("#format", "json_schema")
    assert page.locator("#schema").is_visible()
    page.fill("#schema", json.dumps(SCHEMA))
    page.fill("#max-tokens", "200")
    set_extra(page, {"seed": 3, "temperature": 1.0})
    send(page, "Give me the JSON.")
    turn = last_turn(page)
    assert turn.locator(".badge.good").inner_text() == "valid JSON"
    jsonschema.validate(json.loads(turn.locator("pre.json").inner_text()), SCHEMA)


def test_tool_call_is_shown_and_its_result_sent_back(page):
    page.fill("#tools", json.dumps(WEATHER))
    page.select_option("#tool-choice", "required")
    page.fill("#temperature", "0")  # the page sends no seed: greedy keeps it repeatable
    page.fill("#max-tokens", "300")
    send(page, "Weather in Paris?")
    turn = last_turn(page)
    assert turn.get_attribute("data-finish") == "tool_calls"
    card = turn.locator(".tool-call[data-name=get_weather]")
    args = json.loads(card.locator(".tool-args").inner_text())
    assert args["city"] in {"Paris", "Rome"}
    # Answer the call: the result goes back as a tool message and the model goes on.
    page.select_option("#tool-choice", "none")
    turn.locator(".tool-result-input").fill('{"temperature": 21}')
    turn.locator("text=Send tool results").click()
    page.wait_for_selector(".msg.tool")
    assert page.locator(".msg.assistant").count() == 2
    assert last_turn(page).get_attribute("data-finish") in {"stop", "length"}


def test_reasoning_is_shown_folded(page):
    extra = {"guided_grammar": THINK, "separate_reasoning": True, "seed": 1}
    set_extra(page, extra)
    page.fill("#temperature", "1")
    send(page, "Think first.")
    turn = last_turn(page)
    details = turn.locator("details.reasoning")
    assert details.is_visible() and details.get_attribute("open") is None
    assert not turn.locator(".reasoning-text").is_visible()  # folded
    assert turn.locator(".content").inner_text() in {"answer: yes", "answer: no"}
    details.locator("summary").click()
    assert "<think>" not in turn.locator(".reasoning-text").inner_text()
    assert turn.locator(".reasoning-text").is_visible()


def test_copied_curl_and_python_requests_run(page, server):
    page.fill("#system", "Be brief.")
    page.fill("#max-tokens", "8")
    set_extra(page, {"top_k": 5, "ignore_eos": True})
    page.fill("#prompt", "It's a 'quoted' test")
    env = {**os.environ, "TANDEM_API_KEY": API_KEY}
    page.click("#copy-curl")
    curl = page.locator("#code").inner_text()
    page.click("#code-dialog button[value=close]")
    assert "Be brief." in curl and '"top_k": 5' in curl
    out = subprocess.run(
        ["bash", "-c", curl], env=env, capture_output=True, text=True, timeout=60
    ).stdout
    chunks = [json.loads(x[6:]) for x in out.splitlines() if x.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    page.click("#copy-python")
    code = page.locator("#code").inner_text()
    assert "extra_body=" in code and "top_k" in code
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


def _load(server, stop: threading.Event) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "load " * 40}],
        "max_tokens": 64,
        "ignore_eos": True,
    }

    def one() -> None:
        while not stop.is_set():
            httpx.post(
                server.url + "/v1/chat/completions",
                json=body,
                headers=server.headers(),
                timeout=60,
            )

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _chart(pg, name: str) -> dict:
    return pg.evaluate(
        """(id) => { const f = document.getElementById(id);
           return {points: Number(f.dataset.points || 0), max: Number(f.dataset.max || 0),
                   last: JSON.parse(f.dataset.last || '{}')}; }""",
        f"chart-{name}",
    )


def test_dashboard_plots_move_under_load(page, server):
    page.click("nav >> text=Dashboard")  # the key is kept for this origin
    page.wait_for_url("**/dashboard")
    page.wait_for_selector("#chart-tps[data-points]")
    page.wait_for_function("Number(document.getElementById('chart-tps').dataset.points) > 0")
    assert not page.locator("#key-dialog[open]").count()
    before = _chart(page, "tps")["points"]
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(server, stop))
    load.start()
    try:
        page.wait_for_function(
            """() => ['tps', 'requests', 'kv', 'ttft', 'itl'].every(n =>
                 Number(document.getElementById('chart-' + n).dataset.max) > 0)""",
            timeout=TIMEOUT_MS,
        )
        # New points arrive once a second; on two busy cores a poll may take longer than
        # that (a fixed 1.5 s here once saw none).
        page.wait_for_function(
            f"Number(document.getElementById('chart-tps').dataset.points) > {before}",
            timeout=TIMEOUT_MS,
        )
        time.sleep(1.5)
    finally:
        stop.set()
        load.join()
    tps = _chart(page, "tps")
    assert tps["points"] > before
    assert _chart(page, "requests")["max"] >= 1
    assert "pool of" in page.locator("#kv-pool").inner_text()
    assert _chart(page, "itl")["last"]["itl_p50_ms"] > 0
    # The prefix cache served the repeated prompt.
    page.wait_for_function(
        "Number(document.getElementById('chart-hit').dataset.max) > 0", timeout=TIMEOUT_MS
    )
    assert page.locator("#tile-tps").inner_text() != "–"
    assert page.locator("#chart-spec").is_hidden()  # no speculation on this server


def test_dashboard_asks_for_the_key_itself(browser, server):
    context = browser.new_context()
    pg = context.new_page()
    pg.goto(server.url + "/dashboard")
    pg.wait_for_selector("#key-dialog[open]")  # /ui/api/stats answered 401
    assert pg.locator("#status").inner_text().startswith("Waiting")
    pg.fill("#key-input", "wrong")
    pg.click("#key-save")
    pg.wait_for_selector("#key-dialog[open]")  # refused: asked again
    assert "refused" in pg.locator("#key-message").inner_text()
    pg.fill("#key-input", API_KEY)
    pg.click("#key-save")
    pg.wait_for_function("Number(document.getElementById('chart-tps').dataset.points) > 0")
    assert "tiny" in pg.locator("#model-name").inner_text()
    context.close()


def test_enter_saves_the_key_and_cancel_stops_the_asking(browser, server):
    context = browser.new_context()
    pg = context.new_page()
    pg.goto(server.url + "/dashboard")
    pg.wait_for_selector("#key-dialog[open]")
    pg.click("#key-dialog button[value=cancel]")
    pg.wait_for_timeout(2500)  # two polls answered 401: no new prompt after Cancel
    assert not pg.locator("#key-dialog[open]").count()
    assert "Stats unavailable" in pg.locator("#status").inner_text()
    pg.click("#key-button")  # asked for explicitly
    pg.fill("#key-input", API_KEY)
    pg.press("#key-input", "Enter")
    pg.wait_for_function("Number(document.getElementById('chart-tps').dataset.points) > 0")
    context.close()


def test_an_empty_answer_and_new_chat_mid_stream_leave_a_usable_chat(page):
    # A stop string at the very start: an answer with no content at all.
    set_extra(page, {"guided_regex": "abc", "stop": ["a"]})
    send(page, "Say nothing.")
    turn = last_turn(page)
    assert turn.locator(".content").inner_text() == ""
    assert turn.get_attribute("data-finish") == "stop"
    set_extra(page, {"ignore_eos": True})
    page.fill("#max-tokens", "16")
    send(page, "Go on.")  # the history holds that empty answer: still a valid request
    assert last_turn(page).get_attribute("data-finish") == "length"
    # A stream cut by "New chat" does not leak into the new conversation.
    page.fill("#max-tokens", "3000")
    send(page, "Write forever.")
    page.wait_for_function(
        "[...document.querySelectorAll('.msg.assistant .content')].pop().textContent.length > 10"
    )
    page.click("#clear")
    page.wait_for_function("!state.controller")
    assert page.evaluate("state.history.length") == 0
    page.fill("#max-tokens", "8")
    send(page, "Hello again.")
    assert last_turn(page).get_attribute("data-finish") == "length"
    assert page.evaluate("state.history.map(m => m.role)") == ["user", "assistant"]


def test_dashboard_plots_speculative_acceptance_when_on(browser, served_model):
    """A server with --speculative: the dashboard shows the accepted share; the others
    (above) hide that chart."""
    spec = Server(served_model, "--speculative", "ngram", "--speculative-min-gain", "0")
    try:
        body = {
            "model": "tiny",
            "prompt": [240, 316, 194, 139, 73, 98] * 4,  # the tiny model loops: runs accepted
            "max_tokens": 60,
            "temperature": 0,
            "ignore_eos": True,
        }
        assert spec.post("/v1/completions", json=body).status_code == 200
        context = browser.new_context()
        pg = context.new_page()
        pg.goto(spec.url + "/dashboard")
        pg.fill("#key-input", API_KEY)
        pg.press("#key-input", "Enter")
        pg.wait_for_selector("#chart-spec:not([hidden])", timeout=TIMEOUT_MS)
        last = _chart(pg, "spec")["last"]["spec_acceptance"]
        assert 0 < last <= 1
        assert "accepted" in pg.locator("#chart-spec .legend").inner_text()
        context.close()
    finally:
        spec.stop()
