"""`AsyncClient`: the asyncio shell around the client core.

Any number of tasks may share one `AsyncClient`: many requests are in flight on one connection,
their replies matched by id. A task that is cancelled, or stops waiting at its timeout, leaves
its request's region spans to the request: they are given back when its reply arrives, never
while the daemon may still read or write them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from prefixd.client import state_steps
from prefixd.client.core import ClientCore, Shell
from prefixd.client.steps import Call, Reserve, Steps, Synchronize
from prefixd.client.leases import Lease, Span
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
from prefixd.errors import DaemonUnavailableError, PrefixdError, RequestTimeoutError
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TokenIds
from prefixd.trust import check_peer, check_socket_path, unreachable
from prefixd.wire.frames import FrameReader
from prefixd.wire.region import send_with_fds

if TYPE_CHECKING:
    from prefixd.client.transfer import Installed, InstalledState, Publisher, WarmUp

T = TypeVar("T")


@dataclass(slots=True)
class _Pending:
    """A request in flight: the future its caller awaits (if it still does) and its spans."""

    future: asyncio.Future[memoryview]  # the reply's body
    spans: tuple[Span, ...]
    waited: bool = True  # False once the caller gave up: nobody will retrieve the outcome


class AsyncClient(Shell):
    """asyncio client; safe to share between tasks of one event loop."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        region_bytes: int = 0,
        token_region_bytes: int = 4 << 20,
        timeout: float = 30.0,
        name: str = "prefixd-async-client",
        serves: Sequence[tuple[str, str]] = (),
        reconnect_wait_s: float = 0.0,
        daemon_uid: int | str | None = None,
    ) -> None:
        """The options are Client's. Use `await AsyncClient.connect(...)` or `async with`."""
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
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, _Pending] = {}
        self._write_lock = asyncio.Lock()
        self._connect_lock = asyncio.Lock()
        self._publisher: Publisher | None = None
        self._closed = False

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str], **options: Any) -> AsyncClient:
        client = cls(socket_path, **options)
        try:
            await client._ensure_connected(wait_s=0.0)
        except BaseException:
            await client.close()
            raise
        return client

    # --- operations (the same as Client's; see there) -------------------------------------------

    async def reserve(self, nbytes: int) -> Lease:
        return await self._run(self._core.reserve(nbytes))

    async def put(
        self,
        identity: Identity,
        token_ids: TokenIds,
        payloads: Sequence[Any],
        *,
        first_block: int = 0,
    ) -> Stored:
        return await self._run(self._core.put(identity, token_ids, payloads, first_block))

    async def put_spans(
        self,
        identity: Identity,
        token_ids: TokenIds,
        spans: Sequence[tuple[int, int]],
        *,
        first_block: int = 0,
    ) -> Stored:
        return await self._run(self._core.put_spans(identity, token_ids, spans, first_block))

    async def lookup(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        *,
        hashes: Sequence[bytes | None] | None = None,
        pin: bool = False,
    ) -> list[Lookup]:
        return await self._run(self._core.lookup(identity, prompts, hashes, pin))

    async def unpin(self, identity: Identity, prompts: Sequence[TokenIds]) -> int:
        """Release one of this connection's pins of each closed block of `prompts` (pinned by
        `lookup(..., pin=True)`); how many were released. A lost connection releases them all."""
        return await self._run(self._core.unpin(identity, prompts))

    async def delete(self, identity: Identity, prompts: Sequence[TokenIds]) -> int:
        """Remove the last closed block of each prompt and every block below it; how many
        blocks went."""
        return await self._run(self._core.delete(identity, prompts))

    async def list_blocks(
        self, *, tenant: str, after: bytes | None = None, limit: int = 1024
    ) -> tuple[list[ListedBlock], bytes | None]:
        """A page of the tenant's stored blocks after the cursor `after`, and the next page's
        cursor (None: the listing is complete)."""
        return await self._run(self._core.list_blocks(tenant, after, limit))

    async def route(
        self, identity: Identity, token_ids: TokenIds, *, hashes: bytes | None = None
    ) -> Routed:
        return await self._run(self._core.route(identity, token_ids, hashes))

    async def load(
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
        return await self._run(
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

    async def hot(self, budget_bytes: int, *, tenant: str, limit: int = 64) -> list[HotPrefix]:
        return await self._run(self._core.hot(budget_bytes, tenant, limit))

    async def put_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        paged: Mapping[str, Sequence[Any]] | None = None,
        checkpoints: Mapping[str, Mapping[int, Any]] | None = None,
        upto_tokens: int | None = None,
        first_block: int = 0,
    ) -> Stored:
        steps = state_steps.put_state(
            self._core,
            identity, token_ids, paged or {}, checkpoints or {}, upto_tokens, first_block
        )
        return await self._run(steps)

    async def lookup_state(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        *,
        hashes: Sequence[bytes | None] | None = None,
    ) -> list[StateLookup]:
        return await self._run(state_steps.lookup_state(self._core, identity, prompts, hashes))

    async def load_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        length: int | None = None,
        deadline_s: float | None = None,
    ) -> StateLoaded:
        steps = state_steps.load_state(self._core, identity, token_ids, length, deadline_s)
        return await self._run(steps)

    async def purge(self, *, dry_run: bool = False, **criteria: Any) -> dict[str, Any]:
        return await self._run(self._core.simple({"op": "purge", "dry_run": dry_run, **criteria}))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._core.simple({"op": "stats"}))

    async def verify(self, *, fix: bool = False, payloads: bool = True) -> dict[str, Any]:
        message = {"op": "verify", "fix": fix, "payloads": payloads}
        reply = await self._run(self._core.simple(message))
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def health(self) -> dict[str, Any]:
        return await self._run(self._core.simple({"op": "health"}))

    async def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one protocol message as it is (for operations this client has no call for, or
        tests); the reply, or its error raised as the error's class."""
        return await self._run(self._core.simple(dict(message)))

    async def load_into(
        self,
        identity: Identity,
        token_ids: TokenIds,
        destinations: Sequence[Any],
        *,
        slots: int = 3,
        wait: bool = True,
        hashes: bytes | None = None,
    ) -> Installed:
        from prefixd.client.transfer import load_into

        steps = load_into(
            self._core, identity, token_ids, destinations, slots=slots, wait=wait, hashes=hashes
        )
        return await self._run(steps)

    async def load_state_into(
        self,
        identity: Identity,
        token_ids: TokenIds,
        destinations: Mapping[str, Sequence[Any]],
        *,
        wait: bool = True,
    ) -> InstalledState:
        from prefixd.client.transfer import load_state_into

        steps = load_state_into(self._core, identity, token_ids, destinations, wait=wait)
        return await self._run(steps)

    async def store_from(
        self,
        identity: Identity,
        token_ids: TokenIds,
        sources: Sequence[Any],
        *,
        first_block: int = 0,
        ready: Any = None,
        region_bytes: int = 256 << 20,
    ) -> asyncio.Future[Stored]:
        """Like Client.store_from; the returned future is an asyncio one."""
        from prefixd.client.transfer import Publisher

        if self._publisher is not None and self._publisher.region_bytes < region_bytes:
            publisher, self._publisher = self._publisher, None
            await asyncio.get_running_loop().run_in_executor(None, publisher.close)
        if self._publisher is None:
            self._publisher = await asyncio.get_running_loop().run_in_executor(
                None, Publisher, self._core, region_bytes
            )
        future = self._publisher.store_from(
            identity, token_ids, sources, first_block=first_block, ready=ready
        )
        return asyncio.wrap_future(future)

    async def warm_up(
        self,
        budget_bytes: int,
        destinations_factory: Callable[[HotPrefix], Sequence[Any] | None],
        *,
        tenant: str,
        limit: int = 64,
        slots: int = 3,
    ) -> WarmUp:
        from prefixd.client.transfer import warm_up

        steps = warm_up(
            self._core, budget_bytes, destinations_factory, tenant=tenant, limit=limit, slots=slots
        )
        return await self._run(steps)

    async def close(self) -> None:
        self._closed = True
        if self._publisher is not None:
            publisher, self._publisher = self._publisher, None
            await asyncio.get_running_loop().run_in_executor(None, publisher.close)
        await self._disconnect(DaemonUnavailableError("the client was closed"))
        self._core.close()

    async def __aenter__(self) -> AsyncClient:
        await self._ensure_connected(wait_s=0.0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- the shell: steps over an asyncio socket ------------------------------------------------

    async def _run(self, steps: Steps[T]) -> T:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                value = await self._perform(step)
            except BaseException as exc:
                error = exc

    async def _perform(self, step: Call | Reserve | Synchronize) -> Any:
        if isinstance(step, Reserve):
            return await step.allocator.acquire_async(
                step.nbytes, timeout=self._core.timeout, largest=step.largest
            )
        if isinstance(step, Synchronize):
            await asyncio.get_running_loop().run_in_executor(None, step.event.synchronize)
            return None
        await self._ensure_connected(wait_s=self._core.reconnect_wait_s)
        instance = self._core.instance
        try:
            return await self._request(step)
        except DaemonUnavailableError:
            if self._closed:
                raise
            await self._ensure_connected(wait_s=self._core.reconnect_wait_s)
            if step.spans and self._core.instance == instance:
                raise  # the same daemon may still work on the lost request: see Client
            return await self._request(step)

    async def _request(self, step: Call) -> Any:
        sock = self._sock
        if sock is None:
            raise DaemonUnavailableError("not connected")
        loop = asyncio.get_running_loop()
        rid, frame = self._core.frame(step.message)
        pending = _Pending(loop.create_future(), step.spans)
        for span in step.spans:
            span.begin_request()
        self._pending[rid] = pending
        try:
            async with self._write_lock:
                if step.fds:
                    sock.setblocking(True)  # a short frame with a descriptor: send it whole
                    try:
                        send_with_fds(sock, frame, step.fds)
                    finally:
                        sock.setblocking(False)
                else:
                    await loop.sock_sendall(sock, frame)
        except OSError as exc:
            await self._disconnect(DaemonUnavailableError(f"connection to the daemon lost: {exc}"))
        try:
            done, _ = await asyncio.wait((pending.future,), timeout=self._core.timeout)
        except BaseException:
            pending.waited = False  # cancelled: the reply (or the connection's end) settles it
            if pending.future.done() and not pending.future.cancelled():
                pending.future.exception()  # retrieved: no "never retrieved" noise
            raise
        if not done:
            pending.waited = False
            raise RequestTimeoutError(
                f"no reply from {self._core.socket_path} within {self._core.timeout:g} s"
            )
        return ClientCore.reply(step.message, pending.future.result())

    async def _ensure_connected(self, *, wait_s: float) -> None:
        if self._sock is not None:
            return
        if self._closed:
            raise DaemonUnavailableError("the client was closed")
        async with self._connect_lock:
            if self._sock is not None:
                return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            delay = 0.02
            while True:
                try:
                    await self._connect_once()
                    return
                except DaemonUnavailableError:
                    if loop.time() + delay > deadline:
                        raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _connect_once(self) -> None:
        loop = asyncio.get_running_loop()
        path = os.fspath(self._core.socket_path)
        check_socket_path(self._core.socket_path, self._core.daemon_uids)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, path), self._core.timeout)
        except (TimeoutError, OSError) as exc:
            sock.close()
            raise unreachable(self._core.socket_path, exc) from None
        try:
            check_peer(sock, self._core.daemon_uids)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._reader = asyncio.create_task(self._read_replies(sock), name="prefixd-replies")
        try:
            greeting = self._core.greeting()
            reply = None
            while True:
                try:
                    step = greeting.send(reply)
                except StopIteration:
                    return
                assert isinstance(step, Call)
                reply = await self._request(step)
        except BaseException:
            await self._disconnect(DaemonUnavailableError("the greeting failed"))
            raise

    async def _read_replies(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        frames = FrameReader()
        try:
            while True:
                view = frames.next_body()
                if view is None:
                    got = await loop.sock_recv_into(sock, frames.space())
                    if not got:
                        raise DaemonUnavailableError("the daemon closed the connection")
                    frames.filled(got)
                    continue
                body = memoryview(bytes(view))  # its task decodes it after the buffer moves on
                rid = ClientCore.reply_id(body)
                if rid is None:
                    continue  # a connection-level error addressed to no request of ours
                pending = self._pending.pop(rid, None)
                if pending is None:
                    continue
                for span in pending.spans:
                    span.end_request(lost=False)
                if pending.waited and not pending.future.done():
                    pending.future.set_result(body)
        except (OSError, PrefixdError) as exc:
            if self._sock is sock:
                await self._disconnect(
                    DaemonUnavailableError(f"connection to the daemon lost: {exc}")
                )

    async def _disconnect(self, reason: DaemonUnavailableError) -> None:
        """Close the connection; every request still in flight is lost with it (its spans stay
        quarantined until a reconnect finds another daemon instance)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            for span in entry.spans:
                span.end_request(lost=True)
            if entry.waited and not entry.future.done():
                entry.future.set_exception(DaemonUnavailableError(str(reason)))
        if any(entry.spans for entry in pending.values()):
            for allocator in self._core.allocators():  # their space may be what others await
                allocator.interrupt(DaemonUnavailableError(f"{reason} (while waiting for space)"))
