"""The shared tier's client in a child process, so that nothing Mooncake does can stall the daemon.

Mooncake's client holds the GIL in `setup` against a master that dies while it connects, and in
`close`: in the daemon's process that stops the event loop. `ChildTier` runs the client in a process
of its own (prefixd.cluster.tier_child) and waits for replies on a socket, the GIL released. A late
reply, a child whose every worker is stuck, or one none of whose calls succeeded for `fresh_after_s`
while the tier was unavailable (a client that lost its master mid-call may fail every call after it
is back) is killed and replaced: its segment leaves the pool with it.

Bulk bytes never cross the socket: buffers are memfds both processes map (`buffer`). A buffer whose
call did not end cleanly is kept out of the pool while a call that could touch it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import IO, Any, Self

import msgspec
import numpy as np

from prefixd.cluster.blocks import KEY_PREFIX
from prefixd.cluster.mooncake import MooncakeSettings
from prefixd.cluster.mooncake_calls import tag
from prefixd.cluster.wire_tier import MAX_MESSAGE, TierCall, TierReply, TierStart, raise_error
from prefixd.errors import TierError, TierUnavailableError, TierValueError

log = logging.getLogger(__name__)

_MIN_BUFFER = 1 << 20


@dataclass(eq=False)
class _Buffer:
    """A memfd both processes map; `mapped_by` is the child generation that has it."""

    id: int
    fd: int
    size: int
    mapping: mmap.mmap
    address: int
    mapped_by: int = -1
    busy: bool = False
    tainted: bool = False  # used by a call that did not end cleanly

    def close(self) -> None:
        os.close(self.fd)
        with contextlib.suppress(BufferError):  # a view still held: unmapped with it
            self.mapping.close()


@dataclass(eq=False)
class _Process:
    generation: int
    popen: subprocess.Popen[bytes]
    sock: socket.socket
    ready: threading.Event = field(default_factory=threading.Event)
    pending: dict[int, Future[TierReply]] = field(default_factory=dict)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    dead: bool = False


_KEY = re.compile(re.escape(KEY_PREFIX.encode()) + rb"[A-Za-z0-9_-]+")


def relay_redacted(lines: IO[bytes], fd: int = 2) -> None:
    """Copy the tier process's stderr to `fd` (the daemon's), line by line until it ends, each
    tier key (Mooncake's errors name them) replaced by its `tag`: a key is derived from a tenant,
    an identity and a block hash, so a log reader could tell a prompt was cached."""
    for line in lines:
        with contextlib.suppress(OSError):  # drained whatever: the child never blocks on it
            os.write(fd, _KEY.sub(lambda key: tag(key.group().decode()).encode(), line))


class ChildTier:
    """A tier (by default SharedTier) run in a child process: `factory` (`module:function`) opens it
    with `settings` as keywords. Every call returns or raises a TierError within `call_timeout_s`; a
    call that does not is the child's end."""

    def __init__(
        self,
        settings: dict[str, Any],
        *,
        factory: str = "prefixd.cluster.mooncake:open_tier",
        call_timeout_s: float,
        cooldown_s: float = 1.0,
        workers: int = 4,
        fresh_after_s: float = 10.0,
        pool_bytes: int = 192 << 20,  # a read-through's three buffers and its staging (bridge)
    ) -> None:
        self._start = TierStart(factory=factory, settings=settings, workers=workers)
        self.call_timeout_s = call_timeout_s
        self.cooldown_s = cooldown_s
        self.fresh_after_s = fresh_after_s
        self.pool_bytes = pool_bytes
        self._buffer_ids = 0
        self._last_answer = 0.0  # when a call last succeeded (or the child started)
        self._lock = threading.Lock()
        self._process: _Process | None = None
        self._generation = 0
        self._next_id = 1
        self._down_until = 0.0
        self._down_reason = ""
        self._closed = False
        self._buffers: dict[int, _Buffer] = {}  # by id(mapping)
        self._child_in_flight = 0
        self._encoder = msgspec.msgpack.Encoder()
        self.restarts = 0

    @classmethod
    def for_mooncake(cls, settings: MooncakeSettings) -> ChildTier:
        """Mooncake's client in a child: a call later than SharedTier's longest is stuck; a child
        with no call succeeding for five timeouts (at least 5 s) is replaced."""
        return cls(
            dataclasses.asdict(settings),
            call_timeout_s=settings.longest_call_s + 1.0,
            cooldown_s=settings.cooldown_s,
            workers=settings.workers,
            fresh_after_s=max(5.0, 5 * settings.timeout_s),
        )

    def start(self) -> None:
        """Start the child now (it also starts on the first call), without waiting."""
        with self._lock:
            if self._process is None and not self._closed:
                self._spawn_locked()

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.popen.pid

    @property
    def in_flight(self) -> int:
        """Calls that may still touch a buffer: ours waiting, and the child's."""
        process = self._process
        return (len(process.pending) if process else 0) + self._child_in_flight

    def connect(self) -> None:
        self._call("connect")

    def close(self) -> None:
        """Ask the child to close its tier (bounded by `call_timeout_s`), then end it."""
        with self._lock:
            if self._closed:
                return
            process = self._process
        if process is not None and not process.dead and process.ready.is_set():
            try:
                self._call("close")
            except TierError as exc:
                log.warning("closing the shared tier's process: %s", exc)
        with self._lock:
            self._closed = True
            process, self._process = self._process, None
        if process is not None:
            self._end(process, kill=False)
        for buffer in self._buffers.values():
            buffer.close()
        self._buffers.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def buffer(self, size: int) -> memoryview:
        """A buffer the child writes into directly; give it back with `release`."""
        with self._lock:
            free = [
                b for b in self._buffers.values() if not b.busy and not b.tainted and b.size >= size
            ]
            if free:
                chosen = min(free, key=lambda b: b.size)
            else:
                chosen = self._new_buffer(max(size, _MIN_BUFFER))
            chosen.busy = True
        return memoryview(chosen.mapping)[:size]

    def release(self, view: memoryview) -> None:
        """Past `pool_bytes` of idle buffers it is unmapped, not kept: a burst of large fetches does
        not leave its memory behind."""
        found = self._buffers.get(id(view.obj))
        if found is None:
            return
        with self._lock:
            found.busy = False
            idle = sum(b.size for b in self._buffers.values() if not b.busy)
            if idle <= self.pool_bytes or found.tainted:
                return
            del self._buffers[id(found.mapping)]
            process = self._process
        if process is not None and found.mapped_by == process.generation and not process.dead:
            with contextlib.suppress(OSError), process.send_lock:
                forget = TierCall(id=0, op="unmap", buffer=found.id)
                process.sock.sendall(self._encoder.encode(forget))
        found.close()

    def _new_buffer(self, size: int) -> _Buffer:
        fd = os.memfd_create("prefixd-tier", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        address = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)
        self._buffer_ids += 1
        buffer = _Buffer(self._buffer_ids, fd, size, mapping, address)
        self._buffers[id(mapping)] = buffer
        return buffer

    def _locate(self, data: Any) -> tuple[_Buffer, int, int] | None:
        """The pooled buffer `data` lies in, its offset and length; None if none."""
        view = memoryview(data)
        buffer = self._buffers.get(id(view.obj))
        if buffer is None or not view.contiguous:
            return None
        address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
        offset = address - buffer.address
        if not 0 <= offset <= buffer.size - view.nbytes:
            return None
        return buffer, offset, view.nbytes

    def put(self, key: str, value: Any, *, overwrite: bool = False) -> None:
        """Read by the child where it lies when in one of our buffers, else copied into one."""
        size = memoryview(value).nbytes
        if size == 0:
            raise TierValueError("the value is empty (Mooncake refuses empty objects)")
        if self._locate(value) is not None:
            self._call("put", keys=[key], data=value, flag=overwrite)
            return
        staging = self.buffer(size)
        try:
            staging[:] = memoryview(value).cast("B")
            self._call("put", keys=[key], data=staging, flag=overwrite)
        finally:
            self.release(staging)

    def get_into(self, key: str, buffer: Any) -> int | None:
        if self._locate(buffer) is not None:
            result = self._call("get_into", keys=[key], data=buffer)
        else:  # into one of ours, then copied
            out = memoryview(buffer).cast("B")
            staging = self.buffer(out.nbytes)
            try:
                result = self._call("get_into", keys=[key], data=staging)
                if result is not None:
                    out[:result] = staging[:result]
            finally:
                self.release(staging)
        return None if result is None else int(result)

    def get_many_into(self, keys: Any, buffer: Any, capacity: int) -> list[int | None]:
        if self._locate(buffer) is None:
            raise TierError("get_many_into needs a buffer from ChildTier.buffer")
        result = self._call("get_many_into", keys=list(keys), data=buffer, capacity=capacity)
        return [None if n is None else int(n) for n in result]

    def get(self, key: str) -> bytes | None:
        size = self.size(key)
        if size is None:
            return None
        out = bytearray(size)
        n = self.get_into(key, out)
        return None if n is None else bytes(out[:n])

    def size(self, key: str) -> int | None:
        result = self._call("size", keys=[key])
        return None if result is None else int(result)

    def exists_many(self, keys: Any) -> list[bool]:
        return [bool(b) for b in self._call("exists_many", keys=list(keys))]

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def remove(self, key: str, *, force: bool = True) -> bool:
        return bool(self._call("remove", keys=[key], flag=force))

    def remove_prefix(self, prefix: str, *, force: bool = True) -> int:
        return int(self._call("remove_prefix", keys=[prefix], flag=force))

    def _call(self, op: str, *, data: Any = None, **fields: Any) -> Any:
        """`fields`: the call's keys, capacity and flag (TierCall)."""
        deadline = time.monotonic() + self.call_timeout_s
        process = self._ready(op, deadline)
        located = None if data is None else self._locate(data)
        if data is not None and located is None:
            raise TierError(f"{op}: the buffer is not one of this tier's")
        buffer, offset, length = located if located is not None else (None, 0, 0)
        with self._lock:
            call_id = self._next_id
            self._next_id += 1
        buffer_id = 0 if buffer is None else buffer.id
        call = TierCall(call_id, op, buffer=buffer_id, offset=offset, length=length, **fields)
        future: Future[TierReply] = Future()
        process.pending[call_id] = future
        clean = False
        try:
            self._send(process, call, buffer)
            reply = future.result(timeout=max(0.0, deadline - time.monotonic()))
            self._child_in_flight = reply.in_flight
            clean = not reply.error
            now = time.monotonic()
            if clean:
                self._last_answer = now
            if reply.in_flight >= self._start.workers:  # a call after this one cannot start
                self._kill(process, f"all {reply.in_flight} of its calls are stuck")
            elif reply.error == "TierUnavailableError" and now > self._last_answer + (
                self.fresh_after_s
            ):
                self._kill(process, f"no call succeeded for {self.fresh_after_s} s")
            raise_error(reply)
            return reply.result
        except FutureTimeoutError:
            self._kill(process, f"{op}: no answer within {self.call_timeout_s} s")
            raise TierUnavailableError(
                f"{op}: the shared tier's process gave no answer within {self.call_timeout_s} s"
            ) from None
        except OSError as exc:
            self._kill(process, f"{op}: {exc}")
            raise TierUnavailableError(f"{op}: the shared tier's process is gone ({exc})") from None
        finally:
            process.pending.pop(call_id, None)
            if buffer is not None and not clean:
                with self._lock:
                    buffer.tainted = True
            self._untaint()

    def _ready(self, op: str, deadline: float) -> _Process:
        """A started child, waited for until `deadline`; TierUnavailableError when there is none to
        be had (cooling down, or not started in time)."""
        with self._lock:
            if self._closed:
                raise TierError(f"{op}: the shared tier is closed")
            if time.monotonic() < self._down_until:
                raise TierUnavailableError(f"shared tier unavailable ({self._down_reason})")
            if self._process is None:
                self._spawn_locked()
            process = self._process
            assert process is not None
        if not process.ready.wait(max(0.0, deadline - time.monotonic())):
            raise TierUnavailableError(f"{op}: the shared tier's process is not ready yet")
        if process.dead:
            self._kill(process, "it is gone")
            raise TierUnavailableError(f"{op}: the shared tier's process is gone")
        return process

    def _send(self, process: _Process, call: TierCall, buffer: _Buffer | None) -> None:
        with process.send_lock:
            if buffer is not None and buffer.mapped_by != process.generation:
                announce = TierCall(id=0, op="map", buffer=buffer.id, length=buffer.size)
                socket.send_fds(process.sock, [self._encoder.encode(announce)], [buffer.fd])
                buffer.mapped_by = process.generation
            process.sock.sendall(self._encoder.encode(call))

    def _untaint(self) -> None:
        if self.in_flight == 0:
            with self._lock:
                for buffer in self._buffers.values():
                    buffer.tainted = False

    def _spawn_locked(self) -> None:
        self._generation += 1
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "prefixd.cluster.tier_child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,  # relayed without keys (relay_redacted)
            )
        except OSError as exc:
            ours.close()
            self._trip(f"cannot start the tier process: {exc}")
            raise TierUnavailableError(f"cannot start the shared tier's process: {exc}") from None
        finally:
            theirs.close()
        assert popen.stderr is not None
        relay = threading.Thread(
            target=relay_redacted,
            args=(popen.stderr,),
            name="prefixd-tier-log",
            daemon=True,
        )
        relay.start()
        process = _Process(self._generation, popen, ours)
        ours.sendall(self._encoder.encode(self._start))
        self._process = process
        self._child_in_flight = 0
        self._last_answer = time.monotonic()
        threading.Thread(
            target=self._read, args=(process,), name="prefixd-tier-replies", daemon=True
        ).start()

    def _read(self, process: _Process) -> None:
        decoder = msgspec.msgpack.Decoder(TierReply)
        try:
            while True:
                data = process.sock.recv(MAX_MESSAGE)
                if not data:
                    break
                reply = decoder.decode(data)
                if reply.id == 0:
                    process.ready.set()
                    continue
                future = process.pending.get(reply.id)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("the shared tier's process: %s", exc)
        process.dead = True
        process.ready.set()  # whoever waits for it learns it is gone
        for future in list(process.pending.values()):
            if not future.done():
                future.set_exception(TierUnavailableError("the shared tier's process exited"))
        if not self._closed:
            self._kill(process, "it exited" if process.popen.poll() is not None else "its socket")

    def _kill(self, process: _Process, reason: str) -> None:
        """End a failed child (its calls fail) and start the next at once: it is ready, or nearly,
        when the cooldown ends."""
        with self._lock:
            if self._process is not process:
                return  # already replaced
            self._trip(reason)
            self._process = None
            log.warning("restarting the shared tier's process: %s", reason)
            self.restarts += 1
            if not self._closed:
                self._spawn_locked()
        self._end(process, kill=True)

    def _end(self, process: _Process, *, kill: bool) -> None:
        if kill:
            process.popen.kill()
        with contextlib.suppress(OSError):  # end of file for the child, at once (a close
            process.sock.shutdown(socket.SHUT_RDWR)  # waits for our reader's recv to return)
        process.sock.close()
        try:
            process.popen.wait(timeout=self.call_timeout_s)
        except subprocess.TimeoutExpired:
            process.popen.kill()
            process.popen.wait()
        self._child_in_flight = 0
        self._untaint()

    def _trip(self, reason: str) -> None:
        self._down_reason = reason
        self._down_until = time.monotonic() + self.cooldown_s
