"""One client connection: reading frames (with backpressure and timeouts), decoding them, starting
each request's handler and sending the replies. It names no request type: what a handler takes is
its table entry's business (prefixd.daemon.context.Handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

from msgspec import Struct

from prefixd.config.policy import EVERYTHING, Grant
from prefixd.config.settings import Config
from prefixd.daemon.context import Answered, AnyReply, Handler, Later, Request, RequestContext
from prefixd.daemon.inbox import Frame, Inbox, close_fds
from prefixd.daemon.operations import Operations
from prefixd.daemon.outbox import Outbox
from prefixd.daemon.peer import Peer
from prefixd.errors import ProtocolError, RequestError
from prefixd.wire.decoding import decode_request
from prefixd.wire.errors import ErrorCode, code_of
from prefixd.wire.frames import MAX_FDS_PER_FRAME, encode_frame
from prefixd.wire.messages import error_reply, op_of
from prefixd.wire.region import fds_from_ancillary

log = logging.getLogger(__name__)

_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * 4)
# Oversized frames up to this many times the limit are skipped; larger ones close the connection
_DISCARD_FACTOR = 64
# The reader yields after this long without waiting: a busy client must not hold off the others
READ_STRETCH_S = 0.005


class Host(Protocol):
    """What a connection reads of the server that accepted it."""

    @property
    def config(self) -> Config: ...
    @property
    def stats(self) -> Counter[str]: ...
    @property
    def stopping(self) -> asyncio.Event: ...
    @property
    def connections(self) -> set[Connection]: ...


class Connection:
    """One client: reads frames, runs requests concurrently; its Peer holds the client's regions and
    pins."""

    def __init__(
        self,
        server: Host,
        operations: Operations,
        sock: socket.socket,
        *,
        pid: int,
        uid: int,
        groups: Iterable[int] = (),
        grant: Grant = EVERYTHING,
    ) -> None:
        self.server = server
        self.operations = operations
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.max_inflight = server.config.limits.max_inflight
        self.peer = Peer(
            uid,
            grant,
            max_inflight=self.max_inflight,
            groups=groups,
            pinned=operations.services.pinned_bytes,
        )
        self.task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._context: RequestContext | None = None  # made when the connection starts
        self._inbox = Inbox()
        self._requests: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()  # set while fewer than max_inflight requests are under way
        self._room.set()
        self._outbox = Outbox(sock, self._loop)  # replies, in order, never interleaved
        self._draining = False
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._frame_began: float | None = None  # when the partial frame's first bytes came
        self._watching = False
        config = server.config
        self._handshake_ends = time.monotonic() + config.limits.handshake_timeout_s
        self._frame_timeout_s = config.limits.frame_timeout_s
        self._idle_timeout_s = config.limits.idle_timeout_s

    def stop_reading(self) -> None:
        """Shutdown: take no new requests; the ones in flight finish and get their replies."""
        self._draining = True
        if self.task is not None:
            self.task.cancel()

    def regrant(self, grant: Grant | None) -> None:
        """A reload judged the peer again (`grant` None: no longer admitted): its next request is
        held to the verdict, and what it lost is counted and logged once."""
        lost = self.operations.regrant(self.peer, grant)
        if lost is not None:
            self.server.stats["revoked"] += 1
            log.warning(
                "a reload took %s from the connection of pid %d uid %d", lost, self.pid, self.uid
            )

    def cancel(self) -> None:
        """Cancel everything now (grace period over, or a second signal)."""
        self._draining = False
        for request in list(self._requests):
            request.cancel()
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
        self._context = self.operations.context(self.peer)
        try:
            await self._read_frames()
        except (ConnectionError, OSError) as exc:
            log.debug("connection from pid %d ended: %s", self.pid, exc)
        except asyncio.CancelledError:
            pass
        self._unwatch()
        try:
            if self._draining and self._requests:
                await asyncio.gather(*self._requests, return_exceptions=True)
        except asyncio.CancelledError:
            pass
        finally:
            await self._close()

    async def _read_frames(self) -> None:
        config = self.server.config
        inbox = self._inbox
        stretch = time.monotonic()
        while True:
            if time.monotonic() - stretch > READ_STRETCH_S:
                await asyncio.sleep(0)  # frames keep coming without a wait: let others run
                stretch = time.monotonic()
            # Backpressure: with max_inflight requests under way, read nothing more until one is
            # done. The client's further frames wait in the socket (then its send blocks), so a
            # peer that pipelines without reading holds max_inflight tasks, never one per frame.
            while len(self._requests) >= self.max_inflight:
                self._unwatch()  # level-triggered: unread frames would wake the loop for nothing
                self._room.clear()
                await self._room.wait()
            frame = inbox.next_frame(config.limits.max_frame_bytes)
            if frame is None:
                if not await self._fill():
                    return
                continue
            self._frame_began = None
            if isinstance(frame, Frame):
                self._start(frame.body, frame.fds)
                continue
            limit = config.limits.max_frame_bytes
            message = f"frame of {frame.length} bytes exceeds the limit of {limit}"
            await self._send(self._error(None, ErrorCode.FRAME_TOO_LARGE, message))
            if frame.length > limit * _DISCARD_FACTOR:
                return  # cannot resynchronise cheaply: close
            inbox.skip(frame.length)

    async def _fill(self) -> bool:
        """Read more of the stream into the inbox; False on EOF. TimeoutError when hello, a begun
        frame or the next request does not come in time: a peer cannot hold a connection with half a
        frame (or nothing) for ever."""
        inbox = self._inbox
        at_boundary = inbox.empty
        started = time.monotonic()
        if not self.peer.greeted:
            deadline: float | None = self._handshake_ends
        elif at_boundary:
            deadline = started + self._idle_timeout_s if self._idle_timeout_s else None
        else:  # a frame once begun arrives within frame_timeout_s, however slowly it trickles
            if self._frame_began is None or inbox.skipping:
                self._frame_began = started
            deadline = self._frame_began + self._frame_timeout_s
        if at_boundary and self._inline_ready():
            # The usual wait for the next request: the reader callback answers what it can
            # itself (see _wake); a recv now would only say EAGAIN.
            await self._readable(deadline)
            if not inbox.empty:
                return True
        while True:
            try:
                got = self._recv()
            except (BlockingIOError, InterruptedError):
                await self._readable(deadline)
                if not inbox.empty and at_boundary:
                    return True  # the reader callback read (and left) a frame
                continue
            if got == 0:
                if not inbox.empty:
                    log.debug("connection from pid %d closed mid-frame", self.pid)
                return False
            return True

    def _recv(self) -> int:
        """One read into the inbox, with its descriptors; the bytes read (0: end of file)."""
        got, ancillary, flags, _ = self.sock.recvmsg_into([self._inbox.space()], _ANCILLARY_BYTES)
        if got:
            fds = fds_from_ancillary(ancillary) if ancillary else []
            self._inbox.filled(got, fds, bool(flags & socket.MSG_CTRUNC))
        return got

    def _inline_ready(self) -> bool:
        return (
            self.peer.greeted
            and not self._draining
            and not self.server.stopping.is_set()
            and len(self._requests) < self.max_inflight
        )

    def _start(self, body: memoryview, fds: list[int]) -> None:
        """Decode one frame and start its request; `fds` arrived with this frame."""
        try:  # never past max_inflight: both readers stop reading there (backpressure)
            message = decode_request(body)
        except RequestError as exc:
            close_fds(fds)
            self._spawn(self._refuse(exc))
            return
        rid = message.id
        handler = self.operations.handlers[type(message)]
        if fds and not handler.takes_fds:
            close_fds(fds)  # a descriptor belongs to the frame it came with
            fds = []
        request = Request(rid, message, tuple(fds))
        context = self._context
        assert context is not None
        work: Later = functools.partial(handler.run, context, request)
        if handler.now is not None and self._refusal(handler) is None:
            received = time.perf_counter()
            try:
                outcome = handler.now(context, request)
            except ProtocolError:
                outcome = work  # the usual path reports it
            if isinstance(outcome, Answered):
                self._answered(op_of(message), outcome, received)
                return
            work = outcome
        self._spawn(self._handle(handler, request, work))

    def _answered(self, op: str, answered: Answered, received: float) -> None:
        self.server.stats[f"requests.{op}"] += 1
        self._reply_now(answered.reply)
        sent = time.perf_counter()
        if answered.after is not None:
            answered.after()  # after the reply left: the counting is off the client's wait
        self.operations.services.metrics.observe_op(op, sent - received)

    def _refusal(self, handler: Handler) -> ProtocolError | None:
        """Why a request of `handler` is not taken now: a reload took the peer off the socket,
        before hello, or while the daemon drains."""
        if not self.peer.admitted:
            return ProtocolError(
                ErrorCode.FORBIDDEN,
                f"uid {self.uid} may no longer use this daemon (a reload took it off allowed_uids "
                "and allowed_gids): the connection closes",
            )
        if not (handler.before_hello or self.peer.greeted):
            return ProtocolError(ErrorCode.HELLO_REQUIRED, "send hello first")
        if self.server.stopping.is_set() and not handler.while_stopping:
            return ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        return None

    async def _refuse(self, exc: RequestError) -> None:
        """Reply to a frame that decoded to no request (as a task: in order with the requests before
        it)."""
        refused: ProtocolError = exc
        if exc.op is not None:
            refused = self._refusal(self.operations.by_op[exc.op]) or exc
        await self._send(self._error(exc.rid, code_of(refused), refused.message))
        if not self.peer.admitted:
            self.stop_reading()

    def _error(self, rid: int | None, code: ErrorCode | None, message: str) -> Struct:
        """An error reply, counted by its code (None: no code of the protocol's, a bug: internal)."""
        code = code or ErrorCode.INTERNAL
        self.server.stats[f"errors.{code.value}"] += 1
        return error_reply(rid, code, message)

    def _reply_now(self, reply: Struct) -> None:
        """A reply the socket does not take at once is waited for by a task, which counts as a
        request in flight (backpressure)."""
        sending = self._outbox.send(encode_frame(reply))
        if sending is not None:
            self._spawn(_sent(sending))

    def _spawn(self, coroutine: Any) -> None:
        task = self._loop.create_task(coroutine)
        self._requests.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._requests.discard(task)
        if len(self._requests) < self.max_inflight:
            self._room.set()

    async def _handle(self, handler: Handler, request: Request[Any], work: Later) -> None:
        rid, op = request.id, op_of(request.message)
        reply: AnyReply
        try:
            refused = self._refusal(handler)
            if refused is not None:
                close_fds(list(request.fds))
                raise refused
            started = time.perf_counter()
            reply = await work()
            self.operations.services.metrics.observe_op(op, time.perf_counter() - started)
            self.server.stats[f"requests.{op}"] += 1
        except ProtocolError as exc:
            reply = self._error(rid, code_of(exc), exc.message)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("operation %s failed", op)
            reply = self._error(rid, ErrorCode.INTERNAL, "internal error (see the daemon log)")
        await self._send(reply)
        if not self.peer.admitted:  # as at accept: one `forbidden`, then the connection closes
            self.stop_reading()

    async def _send(self, message: Struct | dict[str, Any]) -> None:
        """Send a reply after those before it; return once it is out, so a client that does not read
        holds its requests in flight and the reader stops taking more."""
        sending = self._outbox.send(encode_frame(message))
        if sending is not None:
            await _sent(sending)

    async def _readable(self, deadline: float | None = None) -> None:
        """Wait until the socket is readable (TimeoutError past `deadline`). The reader stays
        registered while frames are read: one epoll registration per connection."""
        loop = self._loop
        waiter = loop.create_future()
        self._waiter = waiter
        if not self._watching:
            loop.add_reader(self.sock.fileno(), self._wake)
            self._watching = True
        if deadline is not None:
            at = loop.time() + max(0.0, deadline - time.monotonic())
            self._timer = loop.call_at(at, self._expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self.server.stats["timeouts"] += 1
            waiter.set_exception(TimeoutError("the peer sent nothing in time"))

    def _wake(self) -> None:
        """The socket is readable: answer what can be answered here, else wake the reader task."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if not (self._inbox.empty and self._inline_ready() and self._read_inline()):
            waiter.set_result(None)

    def _read_inline(self) -> bool:
        """One read, and the whole frames it brought started; False leaves the rest to the reader
        task (descriptors, a partial frame, EOF, an error, backpressure)."""
        inbox = self._inbox
        try:
            if not self._recv() or inbox.fds_pending:
                return False  # end of file, or descriptors: the reader task's
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False  # the reader task meets it too
        limit = self.server.config.limits.max_frame_bytes
        began = time.monotonic()
        while self._inline_ready() and time.monotonic() - began <= READ_STRETCH_S:
            frame = inbox.next_frame(limit)
            if not isinstance(frame, Frame):
                break
            self._start(frame.body, frame.fds)
        if not inbox.empty:
            return False
        if self._timer is not None and self._idle_timeout_s:  # a request came: idle anew
            self._timer.cancel()
            waiter = self._waiter
            assert waiter is not None
            at = self._loop.time() + self._idle_timeout_s
            self._timer = self._loop.call_at(at, self._expire, waiter)
        return True

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self.sock.fileno())

    async def _close(self) -> None:
        self._unwatch()
        for request in list(self._requests):
            request.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)
        self._inbox.close_pending()
        self.operations.disconnected(self.peer)
        self._outbox.close()
        with contextlib.suppress(OSError):
            self.sock.close()
        self.server.connections.discard(self)


async def _sent(sending: asyncio.Future[None]) -> None:
    """A cancelled wait leaves the frame to the outbox: the stream stays whole."""
    await asyncio.shield(sending)


async def reply_and_close(sock: socket.socket, code: ErrorCode, message: str) -> None:
    loop = asyncio.get_running_loop()
    frame = encode_frame(error_reply(None, code, message))
    with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
        await asyncio.wait_for(loop.sock_sendall(sock, frame), 1.0)
    sock.close()
