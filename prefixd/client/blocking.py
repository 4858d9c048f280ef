"""`Client`: the blocking shell around the client core, for an engine's hot path and its threads.

Any number of threads may share one `Client`. Requests go over one connection one at a time (a
lock around each round trip, tens of microseconds); region space is leased per operation, so
threads never see each other's bytes, and a thread waiting for space holds no lock.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from prefixd.client import state_steps
from prefixd.client.core import ClientCore, Shell
from prefixd.client.steps import Call, Reserve, Steps, Synchronize
from prefixd.client.leases import Lease
from prefixd.client.polling import DEFAULT_POLL_US, ReplyPolling
from prefixd.client.results import (
    HotPrefix,
    ListedBlock,
    Loaded,
    Lookup,
    Routed,
    StateLoaded,
    StateLookup,
    Stored,
)
from prefixd.errors import (
    BadFrameError,
    DaemonUnavailableError,
    FrameTooLargeError,
    PrefixdError,
    RequestTimeoutError,
)
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TokenIds
from prefixd.trust import check_peer, check_socket_path, unreachable
from prefixd.wire.errors import ErrorCode
from prefixd.wire.frames import FrameReader, decode_body
from prefixd.wire.region import send_with_fds

if TYPE_CHECKING:
    from prefixd.client.transfer import Installed, InstalledState, Publisher, WarmUp

T = TypeVar("T")


class Client(Shell):
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
        """`region_bytes`: the shared region payloads are staged in and loaded into (0: none,
        for lookups only). `token_region_bytes`: where long prompts' token ids are staged.
        `serves`: (model, weights) pairs this engine serves; on connecting, the daemon retires
        the other stored versions of those models. `reconnect_wait_s`: how long a call waits
        for a restarting daemon to come back (with backoff) before DaemonUnavailableError.
        `daemon_uid`: the user the daemon runs as (default: this process's own, or root); a
        socket, socket directory or serving process of another user is refused before anything
        is sent (UntrustedDaemonError, prefixd.trust). `poll_us`: how long a thread polls for a
        reply before it sleeps in recv, for the kinds of request whose last reply came that
        fast, while no other thread waits for a CPU (0: always sleep; see prefixd.client.polling);
        `clock` times it and `crowded` says when other threads wait (default: the kernel's run
        queue)."""
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
        self._publisher: Publisher | None = None
        self._publisher_lock = threading.Lock()
        try:
            with self._lock:
                self._connect(wait_s=0.0)
        except BaseException:
            self._core.close()
            raise

    # --- operations -----------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> Lease:
        """Lease `nbytes` of the region to fill yourself (then `put_spans`), waiting for room."""
        return self._run(self._core.reserve(nbytes))

    def put(
        self,
        identity: Identity,
        token_ids: TokenIds,
        payloads: Sequence[Any],
        *,
        first_block: int = 0,
    ) -> Stored:
        """Stage `payloads` in the region and publish blocks first_block.. of `token_ids`."""
        return self._run(self._core.put(identity, token_ids, payloads, first_block))

    def put_spans(
        self,
        identity: Identity,
        token_ids: TokenIds,
        spans: Sequence[tuple[int, int]],
        *,
        first_block: int = 0,
    ) -> Stored:
        """Publish payloads the engine wrote into leased region space, named by (region offset,
        length) spans; a span outside every held lease is refused (RegionError)."""
        return self._run(self._core.put_spans(identity, token_ids, spans, first_block))

    def lookup(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        *,
        hashes: Sequence[bytes | None] | None = None,
        pin: bool = False,
    ) -> list[Lookup]:
        """The stored prefix of each prompt (one round trip for the whole batch)."""
        return self._run(self._core.lookup(identity, prompts, hashes, pin))

    def unpin(self, identity: Identity, prompts: Sequence[TokenIds]) -> int:
        """Release one of this connection's pins of each closed block of `prompts` (pinned by
        `lookup(..., pin=True)`); how many were released. A lost connection releases them all."""
        return self._run(self._core.unpin(identity, prompts))

    def delete(self, identity: Identity, prompts: Sequence[TokenIds]) -> int:
        """Remove the last closed block of each prompt and every block below it; how many
        blocks went."""
        return self._run(self._core.delete(identity, prompts))

    def list_blocks(
        self, *, tenant: str, after: bytes | None = None, limit: int = 1024
    ) -> tuple[list[ListedBlock], bytes | None]:
        """A page of the tenant's stored blocks after the cursor `after`, and the next page's
        cursor (None: the listing is complete)."""
        return self._run(self._core.list_blocks(tenant, after, limit))

    def route(
        self, identity: Identity, token_ids: TokenIds, *, hashes: bytes | None = None
    ) -> Routed:
        """What this node would serve the prompt and its routing score (no payload is read)."""
        return self._run(self._core.route(identity, token_ids, hashes))

    def load(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        length: int | None = None,
        max_blocks: int | None = None,
        hashes: bytes | None = None,
        first_block: int = 0,
        warm: bool = False,
        deadline_s: float | None = None,
    ) -> Loaded:
        """Load the longest stored prefix of `token_ids` (from `first_block` on, at most
        `length` bytes) into leased region space. The result's views stay valid until it is
        released (`release()`, `with`, or when it and its views are gone). `warm` counts the load
        as restart warm-up in the daemon's stats. Past `deadline_s` seconds (default: the daemon's
        load_deadline_s) the daemon stops reading and answers the verified prefix it has."""
        return self._run(
            self._core.load(
                identity,
                token_ids,
                length=length,
                max_blocks=max_blocks,
                hashes=hashes,
                first_block=first_block,
                warm=warm,
                deadline_s=deadline_s,
            )
        )

    def hot(self, budget_bytes: int, *, tenant: str, limit: int = 64) -> list[HotPrefix]:
        """The tenant's most valuable stored prefixes (by the eviction score) within
        `budget_bytes`."""
        return self._run(self._core.hot(budget_bytes, tenant, limit))

    def put_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        paged: Mapping[str, Sequence[Any]] | None = None,
        checkpoints: Mapping[str, Mapping[int, Any]] | None = None,
        upto_tokens: int | None = None,
        first_block: int = 0,
    ) -> Stored:
        """Stage and publish a hybrid identity's state groups (see Store.put_state)."""
        steps = state_steps.put_state(
            self._core,
            identity, token_ids, paged or {}, checkpoints or {}, upto_tokens, first_block
        )
        return self._run(steps)

    def lookup_state(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        *,
        hashes: Sequence[bytes | None] | None = None,
    ) -> list[StateLookup]:
        """The joint hit of each prompt for a hybrid identity (one round trip)."""
        return self._run(state_steps.lookup_state(self._core, identity, prompts, hashes))

    def load_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        length: int | None = None,
        deadline_s: float | None = None,
    ) -> StateLoaded:
        """Load every verified payload of the joint hit into leased region space; each part's
        `view` holds its bytes until the result is released. Past `deadline_s` seconds (default:
        the daemon's load_deadline_s) the daemon stops reading and answers a miss."""
        steps = state_steps.load_state(self._core, identity, token_ids, length, deadline_s)
        return self._run(steps)

    def purge(self, *, dry_run: bool = False, **criteria: Any) -> dict[str, Any]:
        """Remove entries by tenant, model version or age (see PurgeSelector); the counts."""
        return self._run(self._core.simple({"op": "purge", "dry_run": dry_run, **criteria}))

    def stats(self) -> dict[str, Any]:
        return self._run(self._core.simple({"op": "stats"}))

    def verify(self, *, fix: bool = False, payloads: bool = True) -> dict[str, Any]:
        """Check (or with `fix`, repair) the store the daemon serves; the report."""
        reply = self._run(self._core.simple({"op": "verify", "fix": fix, "payloads": payloads}))
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def health(self) -> dict[str, Any]:
        return self._run(self._core.simple({"op": "health"}))

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one protocol message as it is (for operations this client has no call for, or
        tests); the reply, or its error raised as the error's class."""
        return self._run(self._core.simple(dict(message)))

    # --- into and out of device memory (prefixd.client.transfer; needs torch) -------------------------

    def load_into(
        self,
        identity: Identity,
        token_ids: TokenIds,
        destinations: Sequence[Any],
        *,
        slots: int = 3,
        wait: bool = True,
        hashes: bytes | None = None,
    ) -> Installed:
        """Stream the stored prefix's verified payloads into `destinations` (tensors on any
        device, one per block) through leased staging slots; see prefixd.client.transfer."""
        from prefixd.client.transfer import load_into

        steps = load_into(
            self._core, identity, token_ids, destinations, slots=slots, wait=wait, hashes=hashes
        )
        return self._run(steps)

    def load_state_into(
        self,
        identity: Identity,
        token_ids: TokenIds,
        destinations: Mapping[str, Sequence[Any]],
        *,
        wait: bool = True,
    ) -> InstalledState:
        """A hybrid identity's joint hit into per-group destination tensors."""
        from prefixd.client.transfer import load_state_into

        return self._run(load_state_into(self._core, identity, token_ids, destinations, wait=wait))

    def store_from(
        self,
        identity: Identity,
        token_ids: TokenIds,
        sources: Sequence[Any],
        *,
        first_block: int = 0,
        ready: Any = None,
        region_bytes: int = 256 << 20,
    ) -> Future[Stored]:
        """Publish blocks from device tensors in the background (a connection and region of
        their own, of at least `region_bytes`); the future resolves when they are stored."""
        publisher = self._publisher_for(region_bytes)
        return publisher.store_from(
            identity, token_ids, sources, first_block=first_block, ready=ready
        )

    def warm_up(
        self,
        budget_bytes: int,
        destinations_factory: Callable[[HotPrefix], Sequence[Any] | None],
        *,
        tenant: str,
        limit: int = 64,
        slots: int = 3,
    ) -> WarmUp:
        """After a restart: the tenant's most valuable prefixes into destinations, up to
        `budget_bytes`."""
        from prefixd.client.transfer import warm_up

        steps = warm_up(
            self._core, budget_bytes, destinations_factory, tenant=tenant, limit=limit, slots=slots
        )
        return self._run(steps)

    def _publisher_for(self, region_bytes: int) -> Publisher:
        from prefixd.client.transfer import Publisher

        with self._publisher_lock:
            if self._publisher is not None and self._publisher.region_bytes < region_bytes:
                self._publisher.close()  # waits for the stores under way, then makes room
                self._publisher = None
            if self._publisher is None:
                self._publisher = Publisher(self._core, region_bytes)
            return self._publisher

    @property
    def reply_waits(self) -> dict[str, int]:
        """How this client's replies were waited for: picked up by polling, or asleep in recv
        (see `poll_us`)."""
        polling = self._polling
        return {"polled": polling.polled, "slept": polling.slept}

    def close(self) -> None:
        with self._publisher_lock:
            if self._publisher is not None:
                self._publisher.close()
                self._publisher = None
        with self._lock:
            self._drop()
            self._polling.close()
        self._core.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the shell: steps over a blocking socket ------------------------------------------------

    def _run(self, steps: Steps[T]) -> T:
        """Drive one call's steps; an error of a step is raised inside the call, so it releases
        what it leased on its way out."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                value = self._call(step) if isinstance(step, Call) else self._perform(step)
            except BaseException as exc:
                error = exc

    def _perform(self, step: Reserve | Synchronize) -> Any:
        if isinstance(step, Reserve):
            return step.allocator.acquire(
                step.nbytes, timeout=self._core.timeout, largest=step.largest
            )
        assert isinstance(step, Synchronize)
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
                if step.spans:  # their space may be what other threads wait for
                    for allocator in self._core.allocators():
                        allocator.interrupt(
                            DaemonUnavailableError(f"{lost} (while waiting for space)")
                        )
                self._connect(wait_s=self._core.reconnect_wait_s)
                if step.spans and self._core.instance == instance:
                    # the same daemon may still be working on the lost request: its spans stay
                    # quarantined, and the call fails rather than reuse them
                    raise
                return self._request(step)  # nothing in the region at risk: retry once

    def _request(self, step: Call) -> Any:
        """One round trip on the current connection; the spans the request names are in flight
        until its reply arrives (a lost one leaves them quarantined)."""
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
                if ClientCore.reply_id(body) is None:  # an error addressed to no request
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
            greeting = self._core.greeting()
            reply = None
            while True:
                try:
                    step = greeting.send(reply)
                except StopIteration:
                    return
                assert isinstance(step, Call)
                reply = self._request(step)
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
        if ClientCore.reply_id(body) is not None:
            return None
        return _error_of(body)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _receive(self, sock: socket.socket, kind: type) -> memoryview:
        """The next reply's body (valid until the next receive): usually one recv brings it,
        polled for first where a reply to a request of `kind` is likely to come at once."""
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


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound each send and recv by `seconds` in the kernel (SO_SNDTIMEO, SO_RCVTIMEO; a call
    that waits longer fails with EAGAIN), on a blocking socket: Python's own socket timeout
    polls before every send and recv, two more syscalls a round trip."""
    micros = max(1, round(seconds * 1e6))
    timeval = struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.settimeout(None)


def _error_of(body: memoryview) -> PrefixdError:
    """The error of a reply addressed to no request (or BadFrameError for a reply that is no
    error either: the connection is out of step)."""
    try:
        ClientCore.check(decode_body(body))
    except PrefixdError as exc:
        return exc
    return BadFrameError(ErrorCode.BAD_FRAME, "a reply with no id that is no error")


__all__ = ["Client"]
