"""Screenshots of the web pages for the README: `tandem serve` on the default model, a chat
in the playground, then the dashboard after a minute of load. Needs Chromium and playwright
(./scripts/setup.sh --with-browser).

    .venv/bin/python scripts/ui_screenshots.py [--out docs/images] [--load-seconds 60]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

from tandem.model_source import resolve_model
from tandem.testing.browser import find_chromium
from tandem.testing.live_server import API_KEY, Server

NAME = "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "mountains", "a city at night", "bread", "trains", "the moon", "rain"]


def load(server: Server, stop: threading.Event, streams: int) -> None:
    system = "You are a concise assistant. Answer in two or three sentences. " * 4

    def one(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            body = {
                "model": NAME,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Write about {rng.choice(TOPICS)}."},
                ],
                "max_tokens": rng.randint(32, 160),
                "temperature": 0.7,
            }
            httpx.post(
                server.url + "/v1/chat/completions",
                json=body,
                headers=server.headers(),
                timeout=120,
            )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/images")
    ap.add_argument("--load-seconds", type=float, default=60)
    ap.add_argument("--streams", type=int, default=6)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = Server(resolve_model(None), name=NAME, debug_invariants=False)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=find_chromium(), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            page.goto(server.url + "/")
            page.fill("#key-input", API_KEY)
            page.click("#key-save")
            page.fill("#system", "You are a helpful assistant.")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "120")
            for text in ["What is the capital of France?", "Tell me one fact about it."]:
                page.fill("#prompt", text)
                page.click("#send")
                page.wait_for_timeout(300)
                page.locator(".msg.assistant[data-finish]").nth(
                    page.locator(".msg.user").count() - 1
                ).wait_for(timeout=120_000)
            page.select_option("#format", "json_schema")
            schema = {
                "type": "object",
                "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"],
            }
            page.fill("#schema", json.dumps(schema, indent=2))
            page.fill("#prompt", "Answer as JSON: the capital of Italy.")
            page.click("#send")
            page.locator(".msg.assistant[data-finish]").nth(2).wait_for(timeout=120_000)
            page.screenshot(path=str(out / "playground.png"))
            stop = threading.Event()
            worker = threading.Thread(target=load, args=(server, stop, args.streams))
            worker.start()
            page.goto(server.url + "/dashboard")
            page.select_option("#window", "60")
            time.sleep(args.load_seconds)
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            stop.set()
            worker.join()
            browser.close()
    finally:
        server.stop()
    print(f"wrote {out / 'playground.png'} and {out / 'dashboard.png'}")


if __name__ == "__main__":
    main()
