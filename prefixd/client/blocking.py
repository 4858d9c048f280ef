"""`Client`: the blocking shell around the client core, for an engine's hot path and its threads.
Threads share one connection, one round trip at a time under a lock (tens of microseconds); region
space is leased per operation, so threads never see each other's bytes.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, Self, TypeVar

from prefixd.client.core import ClientCore, StepsOf
from prefixd.client.operations import Operations
from prefixd.client.polling import DEFAULT_POLL_US, ReplyPolling
from prefixd.client.steps import Call, Publish, Reserve, Step
from prefixd.client.tensors import TensorOperations
from prefixd.errors import (
    BadFrameError,
    DaemonUnavailableError,
    FrameTooLargeError,
    PrefixdError,
    RequestTimeoutError,
)
from prefixd.trust import check_peer, check_socket_path, unreachable
from prefixd.wire.decoding import reply_id
from prefixd.wire.errors import ErrorCode
from prefixd.wire.frames import FrameReader, decode_body
from prefixd.wire.region import send_with_fds

if TYPE_CHECKING:
    from prefixd.client.transfer import Publisher

P = ParamSpec("P")
S = TypeVar("S")
T = TypeVar("T")


class Client(Operations, TensorOperations):
    """Blocking client; safe to share between threads."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        region_bytes: int = 0,
        token_region_bytes: int = 4 << 20,
        timeout: float = 30.0,
        name: str = "prefixd-client",
        serves: Sequence[tuple[str, str]] = (),
        reconnect_wait_s: float = 0.0,
        daemon_uid: int | str | None = None,
        poll_us: float = DEFAULT_POLL_US,
        clock: Callable[[], float] = time.perf_counter,
        crowded: Callable[[], bool] | None = None,
    ) -> None:
        """`region_bytes`: the shared region payloads are staged in and loaded into (0: lookups
        only); `token_region_bytes`: where long prompts' token ids are staged. `serves`: (model,
        weights) pairs this engine serves, whose other stored versions the daemon retires.
        `reconnect_wait_s`: how long a call waits for a restarting daemon. `daemon_uid`: the
        daemon's user (default: this process's own, or root); another user's socket or process
        is refused before anything is sent (prefixd.trust). `poll_us`: how long to poll for a
        reply before sleeping in recv (0: never; prefixd.client.polling), timed by `clock`,
        while `crowded` (default: the kernel's run queue) says no."""
        self._core = ClientCore(
            socket_path,
            region_bytes=region_bytes,
            token_region_bytes=token_region_bytes,
            timeout=timeout,
            name=name,
            serves=serves,
            reconnect_wait_s=reconnect_wait_s,
            daemon_uid=daemon_uid,
        )
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()  # one round trip at a time on the connection
        self._frames = FrameReader()
        self._polling = ReplyPolling(poll_us * 1e-6, clock, crowded)
        self._publishers = Publishers(self._core)
        try:
            with self._lock:
                self._connect(wait_s=0.0)
        except BaseException:
            self._core.close()
            raise

    @property
    def reply_waits(self) -> dict[str, int]:
        """How this client's replies were waited for: by polling, or asleep in recv."""
        polling = self._polling
        return {"polled": polling.polled, "slept": polling.slept}

    def close(self) -> None:
        self._publishers.close()
        with self._lock:
            self._drop()
            self._polling.close()
        self._core.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the shell: steps over a blocking socket ------------------------------------------------

    def run(self, steps_of: StepsOf[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run one operation's steps on this client's core to its result."""
        return self._drive(steps_of(self._core, *args, **kwargs), self._perform)

    @staticmethod
    def _drive(steps: Generator[S, Any, T], perform: Callable[[S], Any]) -> T:
        """Perform each step and hand its value back to the steps. A step's error is raised
        inside the steps, so they release what they leased on their way out."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                value = perform(step)
            except BaseException as exc:  # noqa: BLE001 - handed back to the steps, which raise it
                error = exc

    def _perform(self, step: Step) -> Any:
        if isinstance(step, Call):
            return self._call(step)
        if isinstance(step, Reserve):
            return step.allocator.acquire(
                step.nbytes, timeout=self._core.timeout, largest=step.largest
            )
        if isinstance(step, Publish):
            return self._publishers.get(step.region_bytes)
        step.event.synchronize()
        return None

    def _call(self, step: Call) -> Any:
        with self._lock:
            if self._sock is None:
                self._connect(wait_s=self._core.reconnect_wait_s)
            instance = self._core.instance
            try:
                return self._request(step)
            except DaemonUnavailableError as lost:
                self._drop()
                if step.spans:
                    self._core.lost_with_spans(lost)
                self._connect(wait_s=self._core.reconnect_wait_s)
                if step.spans and self._core.instance == instance:
                    # the same daemon may still be working on the lost request: its spans stay
                    # quarantined, and the call fails rather than reuse them
                    raise
                return self._request(step)  # nothing in the region at risk: retry once

    def _request(self, step: Call) -> Any:
        """One round trip; the request's spans are in flight until its reply (a lost one leaves
        them quarantined)."""
        sock = self._sock
        assert sock is not None
        rid, frame = self._core.frame(step.message)
        counted = () if step.owned else step.spans  # the call's own spans cannot be released
        for span in counted:
            span.begin_request()
        lost = True
        try:
            try:
                if step.fds:
                    send_with_fds(sock, frame, step.fds)
                else:
                    sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError) as exc:
                # A daemon that refuses a peer replies and closes at once: its refusal may be
                # waiting unread while this send meets the closed end.
                refusal = self._refusal_left(sock)
                if refusal is None:
                    raise DaemonUnavailableError(f"connection to the daemon lost: {exc}") from None
                lost = False  # the daemon never took the request
                raise refusal from None
            kind = type(step.message)
            polling = self._polling
            sent = polling.clock()
            while True:
                body = self._receive(sock, kind)
                try:
                    ours, reply = ClientCore.reply_if_for(step.message, rid, body)
                except PrefixdError as exc:
                    lost = False  # an error reply to this request: the daemon is done with it
                    refused = exc
                    break
                if ours:
                    lost = False  # the daemon is done with the request once it replied
                    polling.took(kind, polling.clock() - sent)
                    return reply
                if reply_id(body) is None:  # an error addressed to no request
                    refused = _error_of(body)
                    break
                # else a reply to an earlier request of this connection: not ours
        except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO / SO_SNDTIMEO
            self._drop()  # the reply may still come: this connection is out of step
            raise RequestTimeoutError(
                f"no reply from {self._core.socket_path} within {self._core.timeout:g} s"
            ) from None
        except PrefixdError:  # some are OSErrors too (ForbiddenError is a PermissionError)
            raise
        except OSError as exc:
            raise DaemonUnavailableError(f"connection to the daemon lost: {exc}") from None
        finally:
            for span in counted:
                span.end_request(lost=lost)
            if lost and step.owned:
                for span in step.spans:
                    span.owner.lose(span)
        raise refused  # outside the I/O handlers: an error reply is never a lost connection

    def _connect(self, *, wait_s: float) -> None:
        """Connect and greet, waiting up to `wait_s` (with backoff) for a restarting daemon."""
        deadline = time.monotonic() + wait_s
        delay = 0.02
        while True:
            try:
                self._connect_once()
                return
            except DaemonUnavailableError:
                if time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _connect_once(self) -> None:
        path = os.fspath(self._core.socket_path)
        check_socket_path(self._core.socket_path, self._core.daemon_uids)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._core.timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise unreachable(self._core.socket_path, exc) from None
        try:
            check_peer(sock, self._core.daemon_uids)
            _kernel_timeouts(sock, self._core.timeout)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._frames = FrameReader()  # nothing read on another connection carries over
        try:
            self._drive(self._core.greeting(), self._request)
        except BaseException:
            self._drop()
            raise

    def _refusal_left(self, sock: socket.socket) -> PrefixdError | None:
        """The error a closed connection left unread (a reply addressed to no request), or None."""
        frames = self._frames
        try:
            while (body := frames.next_body()) is None:
                got = sock.recv_into(frames.space(), 0, socket.MSG_DONTWAIT)
                if not got:
                    return None
                frames.filled(got)
        except OSError:
            return None
        if reply_id(body) is not None:
            return None
        return _error_of(body)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _receive(self, sock: socket.socket, kind: type) -> memoryview:
        """The next reply's body (valid until the next receive), polled for first where a reply
        to a request of `kind` is likely to come at once."""
        frames = self._frames
        try:
            body = frames.next_body()
            if body is None:
                body = self._polling.before_sleeping(sock, frames, kind)
            while body is None:
                got = sock.recv_into(frames.space())
                if not got:
                    raise DaemonUnavailableError("the daemon closed the connection")
                frames.filled(got)
                body = frames.next_body()
        except FrameTooLargeError as exc:  # the stream cannot be followed past it
            raise DaemonUnavailableError(f"connection to the daemon lost: {exc}") from None
        return body


class Publishers:
    """A client's publisher of stores from tensors: opened on first use, with a connection and
    region of its own, and again larger when a store needs more (thread-safe)."""

    def __init__(self, core: ClientCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._publisher: Publisher | None = None

    def get(self, region_bytes: int) -> Publisher:
        from prefixd.client.transfer import Publisher

        with self._lock:
            if self._publisher is not None and self._publisher.region_bytes < region_bytes:
                self._publisher.close()  # waits for the stores under way, then makes room
                self._publisher = None
            if self._publisher is None:
                core = self._core
                client = Client(
                    core.socket_path,
                    region_bytes=region_bytes,
                    timeout=core.timeout,
                    name=f"{core.name}-publisher",
                )
                self._publisher = Publisher(client, region_bytes)
            return self._publisher

    def close(self) -> None:
        with self._lock:
            if self._publisher is not None:
                self._publisher.close()
                self._publisher = None


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound each send and recv in the kernel (SO_SNDTIMEO, SO_RCVTIMEO: EAGAIN past it), on a
    blocking socket: Python's own timeout polls before each, two more syscalls a round trip."""
    micros = max(1, round(seconds * 1e6))
    timeval = struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.settimeout(None)


def _error_of(body: memoryview) -> PrefixdError:
    """The error of a reply addressed to no request (BadFrameError when it is no error)."""
    try:
        ClientCore.check(decode_body(body))
    except PrefixdError as exc:
        return exc
    return BadFrameError(ErrorCode.BAD_FRAME, "a reply with no id that is no error")


__all__ = ["Client", "Publishers"]
