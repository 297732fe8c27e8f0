"""``tandem serve``: the HTTP process. Starts the engine-core process, then uvicorn."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from tandem.config import EngineConfig
from tandem.frontend.engine_client import EngineClient
from tandem.frontend.tokenizer import Tokenizer
from tandem.model_source import DEFAULT_MODEL_NAME, resolve_model
from tandem.server.app import ServerSettings, create_app

KEEP_ALIVE_S = 65  # seconds an idle HTTP connection stays open


async def _serve(config: EngineConfig, host: str, port: int, settings: ServerSettings) -> int:
    import uvicorn

    client = EngineClient(asdict(config))
    await client.start()
    app = create_app(client, Tokenizer.load(resolve_model(config.model)), settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=30,
            # Longer than clients keep idle connections (httpx 5 s, aiohttp 15 s): a server
            # closing one just as a client reuses it resets that client's request.
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )
    client.on_death = lambda reason: setattr(server, "should_exit", True)

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        # The port bound, which ``--port 0`` leaves to the system (tests, side-by-side runs;
        # a host of several addresses then gets one port each: the first is named).
        bound = [s.getsockname()[1] for srv in server.servers for s in srv.sockets or ()]
        name = f"[{host}]" if ":" in host else host
        url = f"http://{name}:{bound[0] if bound else port}"
        print(f"tandem: serving {settings.served_model_name} on {url}", flush=True)

    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal with the handlers it found
    # installed; make those no-ops so a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    task = asyncio.create_task(announce())
    try:
        await server.serve()
    finally:
        task.cancel()
        await client.shutdown()
    if client.dead is not None:
        print(f"tandem: engine died: {client.dead}", file=sys.stderr)
        return 1
    return 0


def default_served_name(model: str | None, path: Path) -> str:
    """What /v1/models lists when --served-model-name is not given."""
    return DEFAULT_MODEL_NAME if model is None else path.name.removesuffix(".gguf")


def serve(
    config: EngineConfig,
    *,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    default_max_tokens: int,
    max_pending: int,
    reasoning: str = "auto",
    tool_call_format: str = "auto",
    keep_billing_header: bool = False,
    trust_request_chat_template: bool = False,
    ui: bool = True,
) -> int:
    path = resolve_model(config.model)  # fetches the default model here, not in the engine
    name = served_model_name or default_served_name(config.model, path)
    config = EngineConfig(**{**asdict(config), "model": str(path)})
    settings = ServerSettings(
        served_model_name=name,
        api_key=api_key,
        default_max_tokens=default_max_tokens,
        max_pending=max_pending,
        reasoning=reasoning,
        tool_call_format=tool_call_format,
        keep_billing_header=keep_billing_header,
        trust_request_chat_template=trust_request_chat_template,
        ui=ui,
    )
    return asyncio.run(_serve(config, host, port, settings))
