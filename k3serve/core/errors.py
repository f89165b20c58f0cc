"""The OpenAI-style error object every HTTP front end sends: `{"error": {"message", "type", "param", "code"}}`.

Here, below the server and the router, so that a replica and the router in front of it answer failures in
the same shape; the web-framework side (exception handlers, responses) stays with each front end.
"""

from __future__ import annotations

# HTTP status -> the error object's "type" (an unknown status reads as a bad request)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_exceeded", 500: "server_error", 502: "server_error",
               503: "service_unavailable", 504: "server_error"}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
