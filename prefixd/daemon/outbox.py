"""The frames a connection still has to send, in the order they were given.

A reply goes out at once when nothing is waiting before it and the socket takes it whole. What the
socket does not take (the rest of a frame, and every frame given after it) waits here, in order,
and is sent as the socket has room (the loop watches the socket for writing only then). So two
replies can never interleave their bytes, as two senders that each send "whatever fits now" would
as soon as one frame was cut short: a reply answered in the reader callback and one sent by a
request task, say. Used on the event loop only.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque


class Outbox:
    """One connection's frames not yet sent."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = loop
        # a frame's unsent rest, and the future its sender waits on
        self._waiting: deque[tuple[memoryview, asyncio.Future[None]]] = deque()
        self._watching = False
        self._closed = False

    def send(self, frame: bytes) -> asyncio.Future[None] | None:
        """Send `frame` after everything given before it: None if it went out whole now, else
        a future done once it has (or once the connection is gone and it is dropped)."""
        if self._closed:
            return None
        view = memoryview(frame)
        if not self._waiting:
            try:
                sent = self._sock.send(view)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:  # the peer is gone; the reader meets it too
                self.close()
                return None
            if sent == len(view):
                return None
            view = view[sent:]
        done: asyncio.Future[None] = self._loop.create_future()
        self._waiting.append((view, done))
        if not self._watching:
            self._loop.add_writer(self._fd, self._drain)
            self._watching = True
        return done

    def close(self) -> None:
        """Drop what waits (the connection is gone or closing); its senders stop waiting, and
        nothing is sent after this."""
        self._closed = True
        self._unwatch()
        while self._waiting:
            _, done = self._waiting.popleft()
            if not done.done():
                done.set_result(None)

    def _drain(self) -> None:
        """The socket has room: send what waits, in order, as far as it goes."""
        while self._waiting:
            view, done = self._waiting[0]
            try:
                sent = self._sock.send(view)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            if sent < len(view):
                self._waiting[0] = (view[sent:], done)
                return
            self._waiting.popleft()
            if not done.done():
                done.set_result(None)
        self._unwatch()

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_writer(self._fd)


__all__ = ["Outbox"]
