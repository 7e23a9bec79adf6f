"""Who may use the server and how much a request may send: the checks a request passes before any route reads it.

`Guard`, an ASGI middleware in front of every route, answers in OpenAI's error shape:
- 503 once the engine has stopped for good (the server then exits), so a health check of any route sees it;
- 400 for a Host header that is not one of this server's names: on a loopback address only loopback names
  (localhost, *.localhost, 127.0.0.0/8, ::1) and `allowed_hosts`, so a web page whose own name resolves to
  127.0.0.1 (DNS rebinding) cannot drive the server; `allowed_hosts=None` accepts any name;
- 401 on /v1/ without `Authorization: Bearer <api_key>`, when the server has a key (the page at / is static
  and asks for the key itself);
- 413 for a Content-Length past the body limit, before a byte of the body is read.

`read_json` then reads a JSON route's body: `Content-Type: application/json` or a 415 (so a cross-site form or
`text/plain` POST, which a browser sends without asking, is refused), at most `max_body_mb` however it is sent
(a 413), within `read_timeout` seconds (a 408), parsed on a worker thread so a large body never holds the event
loop. CORS is off unless `cors_origins` names the origins whose pages may call the API (see create_app).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from gptlite.serve.policy import MB, Policy, is_loopback
from gptlite.serve.protocol import APIError, GenerationRequest, parse_body

CLOSE = {"Connection": "close"}  # on a response that leaves the request's body unread


def host_name(header: str) -> str:
    """A Host header's name without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "[::1]"."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(header: str | None, allowed: tuple[str, ...] | None) -> bool:
    if allowed is None or header is None:  # any name; or no Host at all (HTTP/1.0), which no browser sends
        return True
    name = host_name(header).lower().rstrip(".")
    return is_loopback(name) or name in {a.lower().rstrip(".") for a in allowed}


class Guard:
    """ASGI middleware: a request's host, key and declared size checked before any route runs (see the module
    docstring); `failure()` is why the engine stopped, or None."""

    def __init__(self, app, policy: Policy, failure: Callable[[], str | None]):
        self.app = app
        self.policy = policy
        self.failure = failure

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            problem = self.check(scope, {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
            if problem is not None:  # the body, if any, is left unread: the connection closes after the answer
                headers = {**(problem.headers or {}), **CLOSE}
                response = JSONResponse(problem.body(), status_code=problem.status, headers=headers)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope, headers: dict[str, str]) -> APIError | None:
        failure = self.failure()
        if failure is not None:
            return APIError(503, failure, None, "engine_stopped", "server_error")
        host = headers.get("host")
        if not host_allowed(host, self.policy.allowed_hosts):
            return APIError(
                400,
                f"the Host header {host!r} is not a name of this server; if it is yours (behind a proxy, say), "
                "start the server with --allowed_hosts naming it",
                None,
                "host_not_allowed",
            )
        if self.policy.api_key and scope["path"].startswith("/v1/"):
            scheme, _, key = headers.get("authorization", "").partition(" ")
            sent = key.strip().encode("latin-1")  # the header's own bytes (decoded as latin-1 above)
            if scheme.lower() != "bearer" or not hmac.compare_digest(sent, self.policy.api_key.encode()):
                said = "sent an API key that is not this server's" if sent else "sent no API key"
                return APIError(
                    401,
                    f"the request {said}; send the server's key (its --api_key or GPTLITE_API_KEY) as "
                    "Authorization: Bearer KEY",
                    None,
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get("content-length", "0")
        if length.isdigit() and int(length) > self.policy.max_body:
            return too_large(self.policy, int(length))
        return None


def too_large(policy: Policy, size: int | None = None) -> APIError:
    """The 413 of a body past the limit (of `size` bytes, where its Content-Length said so)."""
    said = "is" if size is None else f"is {size / MB:.1f} MB,"
    return APIError(
        413,
        f"the request body {said} over this server's limit of {policy.max_body_mb:g} MB (its --max_body_mb); "
        "send a smaller body",
        None,
        "body_too_large",
        headers=CLOSE,
    )


async def read_json(request: Request, model: type[GenerationRequest], policy: Policy) -> GenerationRequest:
    """A JSON route's body as `model`: JSON by its Content-Type, within the size and time limits, parsed on a worker
    thread (see the module docstring). A client that goes away meanwhile raises starlette's ClientDisconnect."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(
            415,
            f"the request's Content-Type is {kind or 'missing'!r}; send the body as JSON with "
            "Content-Type: application/json",
            None,
            "unsupported_media_type",
            headers=CLOSE,
        )

    async def read() -> bytes:
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > policy.max_body:
                raise too_large(policy)
        return bytes(body)

    try:
        raw = await asyncio.wait_for(read(), policy.read_timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {policy.read_timeout:g} s (the server's --read_timeout); "
            "send it whole, at once",
            None,
            "request_timeout",
            headers=CLOSE,
        ) from None
    return await asyncio.to_thread(parse_body, raw, model)
