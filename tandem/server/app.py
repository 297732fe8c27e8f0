"""The HTTP app: one ``Service`` (engine client, tokenizer, settings) and the routes of each
API on top of it. Chat templates, tokenization, detokenization, stop strings and SSE all run
here, in the HTTP process; the engine core only sees token ids."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.frontend.engine_client import EngineClient, EngineDeadError
from tandem.frontend.tokenizer import Tokenizer
from tandem.server.anthropic_routes import anthropic_error, install_anthropic_routes
from tandem.server.errors import RequestError
from tandem.server.openai_routes import install_openai_routes
from tandem.server.openapi import install_openapi
from tandem.server.responses_routes import install_responses_routes
from tandem.server.service import ServerSettings, Service, engine_error
from tandem.server.tokenize_api import install_tokenize_routes

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
    """A pydantic-typed body that does not validate: a 400 naming the first offending field."""
    errors = e.errors()
    if not errors:
        return RequestError("invalid request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # A union body (e.g. /tokenize) reports each member's errors under the member's name.
    loc = [x for x in loc if not x[:1].isupper()]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    head = message.split(": ", 1)[0]
    if param is None and head.replace(".", "").replace("[", "").replace("]", "").isidentifier():
        param = head  # a cross-field rule names its field first ("store: ...")
        return RequestError(message, param=param)
    return RequestError(f"{param}: {message}" if param else message, param=param)


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
        """Routing errors (unknown path 404, wrong method 405) in OpenAI's error shape."""
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        response = error_response(
            RequestError(str(e.detail), status=e.status_code, kind=kind), request.url.path
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
    install_tokenize_routes(app, tokenizer, max_model_len, svc.check_model)

    @app.get("/v1/models")
    async def models():
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

    @app.get("/health")
    async def health():
        restarts = client.restarts
        if client.restarting:
            body = {"status": "restarting", "reason": None, "engine_restarts": restarts}
            return JSONResponse(body, status_code=503)
        if not client.healthy:
            body = {"status": "unhealthy", "reason": client.dead, "engine_restarts": restarts}
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "engine_restarts": restarts}

    @app.get("/metrics")
    async def prometheus():
        stats = {**client.stats, "engine_restarts": client.restarts}
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.post("/pause")
    async def pause():
        await client.pause()
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
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
        await self.app(scope, receive, send)

    def _check(self, request: Request) -> RequestError | None:
        settings = self.settings
        if settings.api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            token = token or request.headers.get("x-api-key", "")  # Anthropic's clients
            if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
                return RequestError("invalid API key", status=401, kind="authentication_error")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return RequestError(f"request body exceeds {settings.max_body_bytes} bytes", status=413)
        return None
