"""The client-error exception of the HTTP layer."""

from __future__ import annotations


class RequestError(ValueError):
    """A client error: becomes an OpenAI error body with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind
