"""The HTTP connection under the app: uvicorn's h11 protocol, with a deadline for a request's headers, its own
errors in OpenAI's JSON shape, and a graceful shutdown no client can hold; `uvicorn_config` puts it together.

- A connection whose request's headers are not whole `read_timeout` seconds after it opened, or after their
  first bytes, is closed: a client that opens connections and stalls holds none of them for long. (An idle
  kept-alive connection is uvicorn's, closed after its keep-alive timeout; a body's deadline is the app's:
  gptlite.serve.guard.read_json.)
- A request h11 cannot parse (malformed, or headers past h11's 16 KiB) gets its 400 as JSON in OpenAI's shape,
  where uvicorn would send plain text.
- A response sent before the request's body was read (a 413 for a body past the limit, a 401, a 415) closes the
  connection gently: closing a socket with the client's bytes unread resets it, and a reset can discard the response
  before the client reads it (a client sending a 10 MB body saw "connection reset", not its 413). So the server sends
  its end, reads and drops what the client still sends, and closes once the client has, once nothing has come for
  LINGER seconds, or after read_timeout seconds in all.
- At shutdown, a connection still sending its request's body is closed at once: nothing has started for it,
  and a client that sends part of a body and stalls would otherwise keep the process alive. Requests already
  running get `shutdown_timeout` seconds to finish, then are cancelled.
"""

from __future__ import annotations

import json
import logging

import h11
import uvicorn
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from gptlite.serve.protocol import APIError

log = logging.getLogger("uvicorn.error")  # the server's log
LINGER = 1.0  # seconds a connection that got a 400 is kept open for the client to read it


class Gentle:
    """The socket's transport as uvicorn's request cycles see it: its `close` lingers (see the module docstring)
    where the client is still sending the request's body; everything else is the transport's own."""

    def __init__(self, transport, connection: Connection):
        self._transport = transport
        self._connection = connection

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        if not self._connection.lingering and self._connection.conn.their_state is h11.SEND_BODY:
            self._connection.linger()
        else:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._connection.lingering or self._transport.is_closing()


class Connection(H11Protocol):
    """uvicorn's h11 protocol with the changes of the module docstring; `read_timeout` is set by uvicorn_config."""

    read_timeout: float  # set by uvicorn_config
    header_timer = None
    linger_timer = None
    linger_until = 0.0  # the loop's time at which a lingering connection closes, whatever the client still sends
    lingering = False  # a response has been sent: what the client still sends is read and dropped, until the close

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.socket = transport
        self.transport = Gentle(transport, self)  # what the request cycles are given, and close
        self.arm()  # a connection that sends nothing at all is closed too

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self.linger_timer.cancel()  # the client is still sending: give it LINGER seconds more, up to the limit
            self.linger_timer = self.loop.call_at(min(self.loop.time() + LINGER, self.linger_until), self.socket.close)
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # part of a request's headers: the clock runs from their first bytes
            if self.header_timer is None:
                self.arm()
        elif self.header_timer is not None:  # a whole request's headers are in
            self.header_timer.cancel()
            self.header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self.header_timer, self.linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def linger(self) -> None:
        """The response is sent and the request's body still coming: send our end, then read and drop what the
        client sends until it closes, LINGER seconds pass without a byte, or read_timeout seconds in all."""
        self.lingering = True
        if self.socket.can_write_eof():
            self.socket.write_eof()
        self.socket.resume_reading()  # uvicorn pauses reading while a body waits for the app
        self.linger_until = self.loop.time() + max(self.read_timeout, LINGER)
        self.linger_timer = self.loop.call_later(LINGER, self.socket.close)

    def arm(self) -> None:
        self.header_timer = self.loop.call_later(self.read_timeout, self.headers_late)

    def headers_late(self) -> None:
        """read_timeout has passed and no whole request's headers arrived: close the connection."""
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.info("%s sent no whole request headers within %g s; closed its connection", client, self.read_timeout)
            self.socket.close()

    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        error = APIError(
            400,
            f"the request is not valid HTTP/1.1, or its headers pass {limit // 1024} KiB; send a well-formed "
            "request with shorter headers",
        )
        body = json.dumps(error.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        # Closing now, with the client's bytes unread, would reset the connection, and a reset can discard the
        # 400 before the client reads it: send our end, drop what still comes, close once the client has (or soon).
        self.linger()

    def shutdown(self) -> None:
        if self.lingering:
            self.socket.close()
        elif self.cycle is not None and not self.cycle.response_complete and self.cycle.more_body:
            self.socket.close()  # still sending its body: the app sees the client go away
        else:
            super().shutdown()


def uvicorn_config(
    app,
    host: str,
    port: int,
    read_timeout: float,
    shutdown_timeout: float,
    log_level: str = "info",
    **options,
) -> uvicorn.Config:
    """uvicorn's configuration for serving `app` on host:port through `Connection` (the timeouts in seconds);
    `options` go to uvicorn.Config as they are."""
    protocol = type("Connection", (Connection,), {"read_timeout": read_timeout})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol,
        timeout_graceful_shutdown=shutdown_timeout,
        **options,
    )
