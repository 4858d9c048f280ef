"""The frames a connection still has to send, in order: what the socket does not take at once waits
here and is sent as it has room, so two replies (one answered in the reader callback, one by a
request task) never interleave their bytes. Event loop only.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque


class Outbox:
    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = loop
        # a frame's unsent rest, and the future its sender waits on
        self._waiting: deque[tuple[memoryview, asyncio.Future[None]]] = deque()
        self._watching = False
        self._closed = False

    def send(self, frame: bytes) -> asyncio.Future[None] | None:
        """None if `frame` went out whole now, else a future done once it has (or was dropped with
        the connection)."""
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
        """Drop what waits; its senders stop waiting."""
        self._closed = True
        self._unwatch()
        while self._waiting:
            _, done = self._waiting.popleft()
            if not done.done():
                done.set_result(None)

    def _drain(self) -> None:
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
