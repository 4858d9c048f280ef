"""One client connection: reading frames (with backpressure and timeouts), starting requests,
sending replies, and the regions and descriptors the client shared.

The Server (prefixd.daemon.server) accepts connections and owns what they share: its config,
counters and the stopping flag; the Operations (prefixd.daemon.operations) answer the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from prefixd.daemon.operations import AnyReply, Operations, Request
from prefixd.daemon.policy import EVERYTHING, Grant
from prefixd.errors import ProtocolError, RequestError
from prefixd.wire.decoding import decode_request
from prefixd.wire.errors import ErrorCode, code_of
from prefixd.wire.frames import HEADER, MAX_FDS_PER_FRAME, encode_frame
from prefixd.wire.messages import Lookup, LookupReply, error_reply, op_of
from prefixd.wire.region import MappedRegion, fds_from_ancillary

if TYPE_CHECKING:
    from prefixd.daemon.server import Server

log = logging.getLogger(__name__)

_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * 4)
# An oversized frame's body is read and dropped (keeping the stream in sync) up to this many times
# the frame limit; beyond that the connection is closed.
_DISCARD_FACTOR = 64
# A connection's reader yields to the event loop after reading frames for this long without
# waiting, so that a client whose frames keep arriving cannot hold off signals and other clients.
READ_STRETCH_S = 0.005


class Connection:
    """One client: reads frames, runs requests concurrently, owns the client's regions."""

    def __init__(
        self, server: Server, operations: Operations, sock: socket.socket, *, pid: int, uid: int
    ) -> None:
        self.server = server
        self.operations = operations
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.grant: Grant = EVERYTHING  # what the tenant policy lets this peer do
        self.greeted = False
        self.max_inflight = server.config.max_inflight
        self.regions: dict[int, MappedRegion] = {}
        self.pins: Counter[bytes] = Counter()  # blocks this client pinned (released at its end)
        self.task: asyncio.Task[None] | None = None
        self._next_region = 1
        self._fds: list[int] = []
        self._requests: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()  # set while fewer than max_inflight requests are under way
        self._room.set()
        self._write_lock = asyncio.Lock()
        self._draining = False
        self._waiter: asyncio.Future[None] | None = None
        self._watching = False
        config = server.config
        self._handshake_ends = time.monotonic() + config.handshake_timeout_s
        self._frame_timeout_s = config.frame_timeout_s
        self._idle_timeout_s = config.idle_timeout_s

    # --- state used by operations ---------------------------------------------------------------

    def take_fds(self) -> list[int]:
        fds, self._fds = self._fds, []
        return fds

    @staticmethod
    def close_fds(fds: list[int]) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def add_region(self, region: MappedRegion) -> int:
        region_id = self._next_region
        self._next_region += 1
        self.regions[region_id] = region
        return region_id

    def region(self, region_id: int) -> MappedRegion:
        region = self.regions.get(region_id)
        if region is None:
            raise ProtocolError(ErrorCode.BAD_REGION, f"no region {region_id} on this connection")
        return region

    def span(self, span: tuple[int, int, int]) -> memoryview:
        region_id, offset, length = span
        return self.region(region_id).span(offset, length)

    # --- lifecycle -------------------------------------------------------------------------------

    def stop_reading(self) -> None:
        """Shutdown: take no new requests; the ones in flight finish and get their replies."""
        self._draining = True
        if self.task is not None:
            self.task.cancel()

    def cancel(self) -> None:
        """Cancel everything now (grace period over, or a second signal)."""
        self._draining = False
        for request in list(self._requests):
            request.cancel()
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
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
        header = bytearray(HEADER.size)
        stretch = time.monotonic()
        while True:
            if time.monotonic() - stretch > READ_STRETCH_S:
                await asyncio.sleep(0)  # frames keep coming without a wait: let others run
                stretch = time.monotonic()
            # Backpressure: with max_inflight requests under way, read nothing more until one is
            # done. The client's further frames wait in the socket (then its send blocks), so a
            # peer that pipelines without reading holds max_inflight tasks, never one per frame.
            while len(self._requests) >= self.max_inflight:
                self._room.clear()
                await self._room.wait()
            if not await self._recv_exact(memoryview(header), at_boundary=True):
                return
            (length,) = HEADER.unpack(header)
            if length > config.max_frame_bytes:
                self.server.stats["errors.frame_too_large"] += 1
                message = f"frame of {length} bytes exceeds the limit of {config.max_frame_bytes}"
                await self._send(error_reply(None, ErrorCode.FRAME_TOO_LARGE, message))
                if length > config.max_frame_bytes * _DISCARD_FACTOR:
                    return  # cannot resynchronise cheaply: close
                await self._discard(length)
                self.close_fds(self.take_fds())
                continue
            body = bytearray(length)
            if not await self._recv_exact(memoryview(body), at_boundary=False):
                return  # truncated frame: the stream cannot be resynchronised
            self._start(body, self.take_fds())

    def _start(self, body: bytearray, fds: list[int]) -> None:
        """Decode one frame and start its request; `fds` arrived with this frame."""
        stats = self.server.stats
        try:
            message = decode_request(body)
        except RequestError as exc:
            self.close_fds(fds)
            if exc.rid is not None and len(self._requests) >= self.max_inflight:
                self._busy(exc.rid)
            else:
                self._spawn(self._refuse(exc))
            return
        rid = message.id
        if len(self._requests) >= self.max_inflight:
            self.close_fds(fds)
            self._busy(rid)
            return
        if fds and op_of(message) not in self.operations.takes_fds:
            self.close_fds(fds)  # a descriptor belongs to the frame it came with
            fds = []
        if type(message) is Lookup and self.greeted and not self.server.stopping.is_set():
            received = time.perf_counter()
            try:
                answered = self.operations.lookup_from_memory(self, Request(rid, message))
            except ProtocolError:
                answered = None  # the usual path reports it
            if answered is not None:
                reply, count = answered
                stats["requests.lookup"] += 1
                self._reply_now(reply)
                sent = time.perf_counter()
                count()  # after the reply left: the counting is off the client's wait
                self.operations.metrics.observe_op("lookup", sent - received)
                return
        self._spawn(self._handle(Request(rid, message, tuple(fds))))

    def _busy(self, rid: int) -> None:
        self.server.stats["errors.busy"] += 1
        text = f"at most {self.max_inflight} requests in flight per connection"
        self._spawn(self._send(error_reply(rid, ErrorCode.BUSY, text)))

    def _refusal(self, op: str) -> ProtocolError | None:
        """Why a request of `op` is not taken now, whatever its fields: before hello, or while
        the daemon drains."""
        if op != "hello" and not self.greeted:
            return ProtocolError(ErrorCode.HELLO_REQUIRED, "send hello first")
        if self.server.stopping.is_set() and op != "health":
            return ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        return None

    async def _refuse(self, exc: RequestError) -> None:
        """Reply to a frame that decoded to no request (as a request task: in order with the
        requests before it). A known op's hello_required or shutting_down comes first."""
        refused: ProtocolError = exc
        if exc.op is not None:
            refused = self._refusal(exc.op) or exc
        code = _code(refused)
        self.server.stats[f"errors.{code.value}"] += 1
        await self._send(error_reply(exc.rid, code, refused.message))

    def _reply_now(self, reply: LookupReply) -> None:
        """Send a reply computed on the loop without a task, when no other send is under way."""
        frame = encode_frame(reply)
        sent = 0
        if not self._write_lock.locked():
            try:
                sent = self.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return  # the connection is gone; the read loop will notice
        if sent < len(frame):
            self._spawn(self._send_frame(frame[sent:]))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._requests.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._requests.discard(task)
        if len(self._requests) < self.max_inflight:
            self._room.set()

    async def _handle(self, request: Request[Any]) -> None:
        rid, op = request.id, op_of(request.message)
        stats = self.server.stats
        reply: AnyReply
        try:
            refused = self._refusal(op)
            if refused is not None:
                self.close_fds(list(request.fds))
                raise refused
            started = time.perf_counter()
            reply = await self.operations.handlers[op](self, request)
            self.operations.metrics.observe_op(op, time.perf_counter() - started)
            stats[f"requests.{op}"] += 1
        except ProtocolError as exc:
            code = _code(exc)
            stats[f"errors.{code.value}"] += 1
            reply = error_reply(rid, code, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception:
            stats["errors.internal"] += 1
            log.exception("operation %s failed", op)
            reply = error_reply(rid, ErrorCode.INTERNAL, "internal error (see the daemon log)")
        await self._send(reply)

    # --- socket I/O ------------------------------------------------------------------------------

    async def _send(self, message: Struct | dict[str, Any]) -> None:
        await self._send_frame(encode_frame(message))

    async def _send_frame(self, frame: bytes) -> None:
        loop = asyncio.get_running_loop()
        async with self._write_lock:
            with contextlib.suppress(ConnectionError, OSError):
                await loop.sock_sendall(self.sock, frame)

    async def _recv_exact(self, view: memoryview, *, at_boundary: bool) -> bool:
        """Fill `view`; False on a clean EOF at a frame boundary, or on EOF mid-frame.

        Raises TimeoutError (the connection is closed) when a new connection has not said hello
        within handshake_timeout_s, a frame once begun has not arrived within frame_timeout_s,
        or no request has come for idle_timeout_s: a peer cannot hold a connection with half a
        frame (or nothing) for ever."""
        filled = 0
        started = time.monotonic()
        while filled < len(view):
            if not self.greeted:
                deadline: float | None = self._handshake_ends
            elif at_boundary and filled == 0:
                deadline = started + self._idle_timeout_s if self._idle_timeout_s else None
            else:
                deadline = started + self._frame_timeout_s
            got = await self._recv_into(view[filled:], deadline)
            if got == 0:
                if not (at_boundary and filled == 0):
                    log.debug("connection from pid %d closed mid-frame", self.pid)
                return False
            filled += got
        return True

    async def _recv_into(self, view: memoryview, deadline: float | None = None) -> int:
        while True:
            try:
                got, ancillary, flags, _ = self.sock.recvmsg_into([view], _ANCILLARY_BYTES)
            except (BlockingIOError, InterruptedError):
                await self._readable(deadline)
                continue
            if ancillary:
                fds = fds_from_ancillary(ancillary)
                self._fds.extend(fds)
                if len(self._fds) > MAX_FDS_PER_FRAME or flags & socket.MSG_CTRUNC:
                    self.close_fds(self.take_fds())  # never hoard a flood of descriptors
            return got

    async def _readable(self, deadline: float | None = None) -> None:
        """Wait until the socket is readable (TimeoutError past `deadline`, monotonic). The
        reader stays registered while frames are read (one epoll registration per connection,
        not two syscalls per frame)."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiter = waiter
        if not self._watching:
            loop.add_reader(self.sock.fileno(), self._wake)
            self._watching = True
        timer = None
        if deadline is not None:
            at = loop.time() + max(0.0, deadline - time.monotonic())
            timer = loop.call_at(at, self._expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self.server.stats["timeouts"] += 1
            waiter.set_exception(TimeoutError("the peer sent nothing in time"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _unwatch(self) -> None:
        """Stop watching the socket (level-triggered: an unread socket would wake us again)."""
        if self._watching:
            self._watching = False
            asyncio.get_running_loop().remove_reader(self.sock.fileno())

    async def _discard(self, length: int) -> None:
        scratch = memoryview(bytearray(min(length, 1 << 20)))
        left = length
        while left:
            if not await self._recv_exact(scratch[: min(left, len(scratch))], at_boundary=False):
                raise ConnectionError("closed while an oversized frame was being skipped")
            left -= min(left, len(scratch))

    async def _close(self) -> None:
        self._unwatch()
        for request in list(self._requests):
            request.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)
        self.close_fds(self.take_fds())
        for region in self.regions.values():
            region.close()  # a copy still running on a pool thread keeps the mapping alive
        self.regions.clear()
        if self.pins:
            self.operations.store.unpin(self.pins.elements())
            self.pins.clear()
        with contextlib.suppress(OSError):
            self.sock.close()
        self.server.connections.discard(self)


async def reply_and_close(sock: socket.socket, code: ErrorCode, message: str) -> None:
    loop = asyncio.get_running_loop()
    frame = encode_frame(error_reply(None, code, message))
    with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
        await asyncio.wait_for(loop.sock_sendall(sock, frame), 1.0)
    sock.close()


def _code(exc: ProtocolError) -> ErrorCode:
    """The wire code of a protocol error (`internal` for a code that is none of the protocol's,
    which would be a bug)."""
    return code_of(exc) or ErrorCode.INTERNAL
