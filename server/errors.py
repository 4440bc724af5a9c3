"""One error type for every refusal Sluice makes, with an HTTP status hint.

Like h11's ``error_status_hint``: the code that detects a problem says which
status it deserves; one middleware (server/middleware.py) turns any SluiceError into
an OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``.
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

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
