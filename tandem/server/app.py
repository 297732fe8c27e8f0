"""The HTTP app: one ``Service`` (engine client, tokenizer, settings) and the routes of each
API on top of it. Chat templates, tokenization, detokenization, stop strings and SSE all run
here, in the HTTP process; the engine core only sees token ids."""

from __future__ import annotations

import hmac
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.frontend.engine_client import EngineClient, EngineDeadError
from tandem.frontend.tokenizer import Tokenizer
from tandem.server.anthropic_routes import anthropic_error, install_anthropic_routes
from tandem.server.errors import RequestError, invalid_body
from tandem.server.openai_output_schema import ModelList
from tandem.server.openai_routes import install_openai_routes
from tandem.server.openapi import install_openapi
from tandem.server.responses_routes import install_responses_routes
from tandem.server.service import ServerSettings, Service, engine_error
from tandem.server.tokenize_api import install_tokenize_routes
from tandem.server.ui import install_ui, is_public

__all__ = ["ServerSettings", "create_app", "engine_error", "error_response"]


def error_response(e: RequestError, path: str = "") -> JSONResponse:
    """The error body of the API the path belongs to (Anthropic's under /v1/messages)."""
    if path.startswith("/v1/messages"):
        return anthropic_error(e)
    body = {
        "error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.code or e.status}
    }
    return JSONResponse(body, status_code=e.status)


def validation_error(e: RequestValidationError) -> RequestError:
    """A pydantic-typed body that does not validate (or is not JSON): a 400 naming the first
    offending field."""
    return invalid_body(e.errors())


class HealthStatus(BaseModel):
    status: Literal["ok", "restarting", "unhealthy"]
    reason: str | None = None
    engine_restarts: int


class SchedulingStatus(BaseModel):
    status: Literal["paused", "running"]


def create_app(client: EngineClient, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)
    install_openapi(app)
    svc = Service(client, tokenizer, settings)
    metrics, max_model_len = svc.metrics, svc.max_model_len
    app.add_middleware(_Guard, settings=settings)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, e: RequestError):
        return error_response(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        """Routing errors (unknown path 404, wrong method 405) and bodies FastAPI could not
        read (a 400 whose cause is the JSON decoder's error) in OpenAI's error shape."""
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        message = str(e.detail)
        if e.status_code == 400 and isinstance(e.__cause__, ValueError | RecursionError):
            message = f"malformed JSON: {e.__cause__}"  # e.g. an int past Python's digit limit
        response = error_response(
            RequestError(message, status=e.status_code, kind=kind), request.url.path
        )
        response.headers.update(e.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        return error_response(validation_error(e), request.url.path)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, e: EngineDeadError):
        return error_response(
            RequestError(str(e), status=503, kind="server_error"), request.url.path
        )

    install_openai_routes(app, svc)
    install_anthropic_routes(app, svc)
    install_responses_routes(app, svc)
    install_tokenize_routes(
        app, tokenizer, max_model_len, svc.check_model, settings.trust_request_chat_template
    )

    if settings.ui:
        install_ui(
            app,
            metrics.live,
            lambda: {"kv_pages": client.info.get("kv_pages", 0), **client.stats},
            settings.served_model_name,
            max_model_len,
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        """The served model."""
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tandem",
                    "max_model_len": max_model_len,
                }
            ],
        }

    @app.get(
        "/health",
        response_model=HealthStatus,
        response_model_exclude_unset=True,  # no reason while ok
        responses={
            503: {
                "model": HealthStatus,
                "description": "The engine is restarting after its process died, or gone.",
            }
        },
    )
    async def health():
        """Liveness; never needs the API key."""
        restarts = client.restarts
        if client.restarting:
            body = {"status": "restarting", "reason": None, "engine_restarts": restarts}
            return JSONResponse(body, status_code=503)
        if not client.healthy:
            body = {"status": "unhealthy", "reason": client.dead, "engine_restarts": restarts}
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "engine_restarts": restarts}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        """Prometheus metrics (text exposition format)."""
        stats = {**client.stats, "engine_restarts": client.restarts}
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.post("/pause", response_model=SchedulingStatus)
    async def pause():
        """Stop scheduling (in-flight steps finish; nothing is dropped)."""
        await client.pause()
        return {"status": "paused"}

    @app.post("/resume", response_model=SchedulingStatus)
    async def resume():
        """Restart scheduling."""
        await client.resume()
        return {"status": "running"}

    return app


class _Guard:
    """API key and body-size checks as a plain ASGI middleware (Starlette's
    ``BaseHTTPMiddleware`` hides client disconnects from ``request.is_disconnected()``, so
    a non-streaming request would run on after its client left)."""

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self._check(Request(scope))
            if error is not None:
                await error_response(error, scope.get("path", ""))(scope, receive, send)
                return
            receive = self._bounded(receive)
        await self.app(scope, receive, send)

    def _bounded(self, receive: Any) -> Any:
        """``receive`` that ends a body past the limit with a 413 (one without a
        content-length, sent in chunks): FastAPI passes an HTTPException raised while it reads
        the body on to the app's handler."""
        limit, read = self.settings.max_body_bytes, 0

        async def bounded() -> Any:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise StarletteHTTPException(413, f"request body exceeds {limit} bytes")
            return message

        return bounded

    def _check(self, request: Request) -> RequestError | None:
        settings = self.settings
        path = request.url.path
        public = path == "/health" or (settings.ui and is_public(path))
        if settings.api_key is not None and not public:
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            token = token or request.headers.get("x-api-key", "")  # Anthropic's clients
            if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
                return RequestError("invalid API key", status=401, kind="authentication_error")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return RequestError(f"request body exceeds {settings.max_body_bytes} bytes", status=413)
        return None
