"""The HTTP access log: one line per request, written when its response ends (a stream, when the
stream ends): client, method, path, status, latency.

    2026-05-09 12:00:00,000 INFO k3serve.access: 127.0.0.1:50412 "POST /v1/chat/completions" 200 84.1 ms

Status 499 means the client went away before a response started. On by default; ``k3serve serve
--disable-access-log`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

log = logging.getLogger("k3serve.access")


def access_logger() -> logging.Logger:
    """``k3serve.access`` at INFO on stderr, whatever uvicorn's --log-level is (idempotent)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


class AccessLog:
    """Pure ASGI middleware (no body buffering); logs after the last body chunk is sent."""

    def __init__(self, app, logger: logging.Logger | None = None):
        self.app, self.log = app, logger or access_logger()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 499

        async def logging_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        except asyncio.CancelledError:  # the client left
            raise
        except BaseException:
            if status == 499:
                status = 500
            raise
        finally:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            path = scope.get("path", "")
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            self.log.info('%s "%s %s" %d %.1f ms', who, scope.get("method", "-"), path, status,
                          1000 * (time.perf_counter() - t0))
