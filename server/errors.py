"""One error type for every refusal Sluice makes, with an HTTP status hint.

Like h11's ``error_status_hint``: the code that detects a problem says which
status it deserves; one middleware (server/http/middleware.py) turns any SluiceError into
an OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``, or on
Anthropic's paths (/v1/messages*) Anthropic's ``{"type": "error", "error":
{"type", "message"}}`` with Anthropic's statuses (``anthropic_status``), or on
Ollama's paths (/api/*) Ollama's ``{"error": "..."}`` with the same statuses.
Anything else that escapes a handler becomes a 500 without a stack trace.
"""

from __future__ import annotations

import math
from typing import Any

# OpenAI's error "type" strings, by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}

# Anthropic's error "type" strings, by the status Anthropic answers with
# (docs.anthropic.com/en/api/errors). 529 is Anthropic's "overloaded", the
# status its clients retry where OpenAI's API answers 503.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class SluiceError(Exception):
    """A refusal or failure a client should see as a JSON error.

    ``retry_after`` (seconds) becomes a ``Retry-After`` header, rounded up to a
    whole second as the header requires; 429 and 503 should always carry one.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.error_type = error_type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def anthropic_status(self) -> int:
        """The status on Anthropic's paths: 503 (draining, shedding, no engine) is 529."""
        return 529 if self.status == 503 else self.status

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape has no ``param``: the message names the field
        first, as Anthropic's own do (``messages.0.content: ...``)."""
        status = self.anthropic_status
        kind = _ANTHROPIC_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        message = f"{self.param}: {self.message}" if self.param else self.message
        return {"type": "error", "error": {"type": kind, "message": message}}

    def ollama_body(self) -> dict[str, Any]:
        """Ollama's shape: the message alone (Sluice's messages name the field;
        Ollama's clients read ``error`` and the status, nothing else)."""
        return {"error": self.message}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
