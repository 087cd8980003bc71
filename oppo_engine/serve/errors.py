"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status, and
``x-should-retry: false`` (the ``openai`` client would otherwise retry a 409 or a 5xx on its own)."""

from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "episode_failed",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error answered to the client with ``status``; ``param`` names the request field at fault, ``code``
    is a stable name for the case (``episode_ended``, ``history_diverged``, ...)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
