"""uvicorn's h11 protocol with deadlines on reading a request: a connection whose request's head has not arrived
HEAD_TIMEOUT_SECONDS after the connection (or after the previous response), or whose body has not arrived
BODY_TIMEOUT_SECONDS after its head, is closed. uvicorn's own keep-alive timeout restarts at every byte received and
starts only after a first response, so a socket that never sends, or sends its headers a byte at a time, would be
held for as long as the client likes."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_SECONDS = 10.0  # a request's headers, all of them
BODY_TIMEOUT_SECONDS = 30.0  # its body, all of it: the 8 MiB limit at ~280 KB/s


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol with a deadline for each part of a request the client owes; none while the server answers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._owed: str | None = None  # "head", "body", or None while the request is answered

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _follow(self) -> None:
        # a deadline starts when the client begins to owe a part, and is not moved by the bytes of that part
        state = self.conn.their_state
        owed = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if owed == self._owed:
            return
        self._cancel()
        self._owed = owed
        if owed is not None:
            seconds = HEAD_TIMEOUT_SECONDS if owed == "head" else BODY_TIMEOUT_SECONDS
            self._deadline = self.loop.call_later(seconds, self._expire)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()  # a request mid-body then sees its client gone (app.py: a 499 nobody reads)
