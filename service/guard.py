"""The first thing every request meets: the size of its body, then its token, before any parsing.

An ASGI middleware (no per-request task, like `LatencyMiddleware`):

1. A body over ``max_body_bytes`` is refused with 413, by its ``Content-Length`` before a byte is
   read, or as soon as a streamed body goes over.
2. Under ``/v1/`` with auth on, a request without a valid, unrevoked bearer token is refused with
   401 before its body is read, so an anonymous caller cannot make the server hold or parse
   anything.  (Which role may do what is checked later, per route.)
3. Only then is the body, at most ``max_body_bytes``, handed to the app.

Every answer, refusals included, says ``Referrer-Policy: no-referrer``: no URL of ours (a dashboard
page, say) travels on in a browser's Referer.
"""

from __future__ import annotations

import json

from cmtune.service.deps import AppState, authenticate
from cmtune.service.errors import UnauthorizedError

WITH_BODY = {"POST", "PUT", "PATCH", "DELETE"}
NO_REFERRER = (b"referrer-policy", b"no-referrer")


class GuardMiddleware:
    def __init__(self, app, *, state: AppState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send_on):
        if scope["type"] != "http":
            return await self.app(scope, receive, send_on)

        async def send(message):
            if message["type"] == "http.response.start":
                message = message | {"headers": [*message.get("headers", []), NO_REFERRER]}
            await send_on(message)

        limit = self.state.settings.max_body_bytes
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _refuse(send, 413, f"request body over {limit} bytes (CMTUNE_MAX_BODY_BYTES)")
        if scope["path"].startswith("/v1/") and self.state.settings.auth != "off":
            try:
                await authenticate(self.state, headers.get(b"authorization", b"").decode("latin-1"))
            except UnauthorizedError as exc:
                return await _refuse(send, 401, exc.message, {"www-authenticate": "Bearer"})
        if scope["method"] not in WITH_BODY:
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _refuse(send, 413, f"request body over {limit} bytes (CMTUNE_MAX_BODY_BYTES)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # after the body: the client's disconnect, if it comes
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


async def _refuse(send, status: int, detail: str, extra: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
