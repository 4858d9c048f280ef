"""Clients for the daemon: `Client` (blocking, for an engine's hot path) and `AsyncClient`.

Both share a memory region with the daemon (a sealed memfd, see prefixd.wire.region): payloads
are staged in it for puts and loaded into it by the daemon, so bulk data never crosses the socket.
Both reconnect after a daemon restart (re-attaching the same region) and retry the request once:
every operation is idempotent.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TokenIds, as_token_array
from prefixd.errors import DaemonUnavailableError, PrefixdError, RemoteError
from prefixd.wire.errors import error_for
from prefixd.wire.frames import HEADER, PROTOCOL_VERSION, decode_body, encode_frame
from prefixd.wire.region import SharedRegion, send_with_fds

if TYPE_CHECKING:
    from prefixd.transfer import Installed, InstalledState, Publisher, WarmUp

__all__ = [
    "AsyncClient",
    "Client",
    "DaemonUnavailableError",
    "HotPrefix",
    "Loaded",
    "Lookup",
    "RemoteError",
    "StateLoaded",
    "StateLookup",
    "StatePart",
    "Stored",
]


@dataclass(frozen=True, slots=True)
class Lookup:
    """How much of one prompt is stored: `n_tokens` tokens in `n_blocks` blocks of `sizes` bytes."""

    n_blocks: int
    n_tokens: int
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stored:
    stored: int
    existed: int
    parts: int = 0


@dataclass(frozen=True, slots=True)
class StatePart:
    """One state-group payload of a hybrid hit: a page covering tokens [first_token,
    first_token + tokens), or the checkpoint at first_token (tokens 0). After a load, `view` is
    its verified bytes in the client's region."""

    group: str
    first_token: int
    tokens: int
    size: int
    offset: int = -1
    view: memoryview | None = None


@dataclass(frozen=True, slots=True)
class StateLookup:
    """A hybrid identity's joint hit (see prefixd.store.joint.JointMatch): every state group is
    complete at `reusable_tokens`; the engine recomputes from `replay_from`."""

    reusable_tokens: int
    replay_from: int
    paged_tokens: int
    matched_tokens: int
    parts: tuple[StatePart, ...]

    def by_group(self) -> dict[str, list[StatePart]]:
        """The parts of each group, in order (a paged group's pages, or one checkpoint)."""
        groups: dict[str, list[StatePart]] = {}
        for part in self.parts:
            groups.setdefault(part.group, []).append(part)
        return groups


StateLoaded = StateLookup  # a load's answer: the same fields, each part with its `view`


@dataclass(frozen=True, slots=True)
class Loaded:
    """Verified payloads of `n_blocks` blocks from `first_block` on, in the client's region
    (valid until the region is reused or closed); the prefix is usable up to `n_tokens`."""

    n_blocks: int
    n_tokens: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    views: tuple[memoryview, ...]
    first_block: int = 0  # views[i] is block first_block + i's payload


@dataclass(frozen=True)
class HotPrefix:
    """A prefix the daemon ranks among the most valuable (see Client.hot)."""

    identity: Identity
    tokens: np.ndarray
    sizes: tuple[int, ...]
    score: float


INLINE_TOKEN_BYTES = 16 << 10  # longer prompts go through the token region, not the socket


class _Requests:
    """Builds request messages and reads replies; shared by both clients.

    With a token region (blocking client only: one request at a time), long prompts' token ids
    are written there and named by `tokens_span`; otherwise they travel inline as one bin."""

    def __init__(self, region_bytes: int, token_region_bytes: int = 0) -> None:
        self.region = SharedRegion(region_bytes) if region_bytes else None
        self.region_id: int | None = None
        self.token_region = (
            SharedRegion(token_region_bytes, name="prefixd-tokens") if token_region_bytes else None
        )
        self.token_region_id: int | None = None
        self._token_offset = 0
        self._ids = itertools.count(1)
        self._identities: dict[int, tuple[Identity, dict[str, Any]]] = {}

    def regions(self) -> list[tuple[str, SharedRegion]]:
        """The regions to attach after connecting, by the attribute that keeps their id."""
        pairs = [("region_id", self.region), ("token_region_id", self.token_region)]
        return [(name, region) for name, region in pairs if region is not None]

    def tokens(self, token_ids: TokenIds) -> dict[str, Any]:
        """The token fields of a request: staged in the token region when long, else inline."""
        tokens = as_token_array(token_ids)
        region = self.token_region
        end = self._token_offset + tokens.nbytes
        if region is None or tokens.nbytes < INLINE_TOKEN_BYTES or end > region.size:
            return {"tokens": tokens.tobytes(), "n_tokens": len(tokens)}
        np.copyto(np.frombuffer(region.view[self._token_offset : end], dtype=tokens.dtype), tokens)
        span = [self.token_region_id, self._token_offset, len(tokens)]
        self._token_offset = end
        return {"tokens_span": span, "n_tokens": len(tokens)}

    def begin(self) -> None:
        """A new request: the token region's staging area is free again."""
        self._token_offset = 0

    def next_id(self) -> int:
        return next(self._ids)

    def identity(self, identity: Identity) -> dict[str, Any]:
        cached = self._identities.get(id(identity))
        if cached is None or cached[0] is not identity:
            cached = (identity, identity.to_dict())
            self._identities[id(identity)] = cached
        return cached[1]

    def require_region(self) -> SharedRegion:
        if self.region is None or self.region_id is None:
            raise PrefixdError("this client has no shared region: pass region_bytes")
        return self.region

    def stage(self, payloads: Sequence[Any]) -> list[list[int]]:
        """Copy payloads back to back into the region; the spans a put request names."""
        region = self.require_region()
        spans, offset = [], 0
        for payload in payloads:
            data = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
            end = offset + data.nbytes
            if end > region.size:
                raise PrefixdError(f"payloads need {end} bytes, the region holds {region.size}")
            np.copyto(np.frombuffer(region.view[offset:end], dtype=np.uint8), data)
            spans.append([self.region_id, offset, data.nbytes])
            offset = end
        return spans

    def put(
        self,
        identity: Identity,
        token_ids: TokenIds,
        spans: Sequence[Sequence[int]],
        first_block: int,
    ) -> dict[str, Any]:
        return {
            "op": "put",
            "identity": self.identity(identity),
            **self.tokens(token_ids),
            "first_block": first_block,
            "blocks": [list(span) for span in spans],
        }

    def lookup(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        hashes: Sequence[bytes | None] | None,
    ) -> dict[str, Any]:
        entries = []
        for i, prompt in enumerate(prompts):
            entry = self.tokens(prompt)
            if hashes is not None and hashes[i] is not None:
                entry["hashes"] = hashes[i]
            entries.append(entry)
        return {"op": "lookup", "identity": self.identity(identity), "prompts": entries}

    def load(
        self,
        identity: Identity,
        token_ids: TokenIds,
        offset: int,
        length: int | None,
        max_blocks: int | None,
        hashes: bytes | None,
        first_block: int = 0,
        warm: bool = False,
    ) -> dict[str, Any]:
        region = self.require_region()
        message: dict[str, Any] = {
            "op": "load",
            "identity": self.identity(identity),
            **self.tokens(token_ids),
            "region": self.region_id,
            "offset": offset,
            "length": region.size - offset if length is None else length,
        }
        if max_blocks is not None:
            message["max_blocks"] = max_blocks
        if hashes is not None:
            message["hashes"] = hashes
        if first_block:
            message["first_block"] = first_block
        if warm:
            message["warm"] = True
        return message

    @staticmethod
    def lookups(reply: dict[str, Any]) -> list[Lookup]:
        return [
            Lookup(r["n_blocks"], r["n_tokens"], tuple(np.frombuffer(r["sizes"], "<u8").tolist()))
            for r in reply["results"]
        ]

    def loaded(self, reply: dict[str, Any]) -> Loaded:
        region = self.require_region()
        offsets = tuple(np.frombuffer(reply["offsets"], "<u8").tolist())
        sizes = tuple(np.frombuffer(reply["sizes"], "<u8").tolist())
        views = tuple(region.view[o : o + n] for o, n in zip(offsets, sizes))
        first = reply.get("first_block", 0)
        return Loaded(reply["n_blocks"], reply["n_tokens"], offsets, sizes, views, first)

    def stage_state(
        self,
        paged: Mapping[str, Sequence[Any]],
        checkpoints: Mapping[str, Mapping[int, Any]],
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stage a hybrid put's payloads in the region: the `paged` and `checkpoints` fields."""
        payloads = [*(p for name in paged for p in paged[name])]
        payloads += [p for name in checkpoints for p in checkpoints[name].values()]
        spans = iter(self.stage(payloads))
        paged_spans = {name: [next(spans) for _ in paged[name]] for name in paged}
        checkpoint_spans = {
            name: [[boundary, next(spans)] for boundary in placed]
            for name, placed in checkpoints.items()
        }
        return paged_spans, checkpoint_spans

    def put_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        paged: dict[str, Any],
        checkpoints: dict[str, Any],
        upto_tokens: int | None,
        first_block: int,
    ) -> dict[str, Any]:
        message = {
            "op": "put_state",
            "identity": self.identity(identity),
            **self.tokens(token_ids),
            "first_block": first_block,
            "paged": paged,
            "checkpoints": checkpoints,
        }
        if upto_tokens is not None:
            message["upto_tokens"] = upto_tokens
        return message

    def load_state(
        self, identity: Identity, token_ids: TokenIds, offset: int, length: int | None
    ) -> dict[str, Any]:
        region = self.require_region()
        return {
            "op": "load_state",
            "identity": self.identity(identity),
            **self.tokens(token_ids),
            "region": self.region_id,
            "offset": offset,
            "length": region.size - offset if length is None else length,
        }

    def state(self, result: dict[str, Any], loaded: bool = False) -> StateLookup:
        region = self.require_region() if loaded else None
        parts = tuple(
            StatePart(
                p["group"],
                p["first_token"],
                p["tokens"],
                p["size"],
                p.get("offset", -1),
                region.view[p["offset"] : p["offset"] + p["size"]] if region else None,
            )
            for p in result["parts"]
        )
        return StateLookup(
            result["reusable_tokens"],
            result["replay_from"],
            result["paged_tokens"],
            result["matched_tokens"],
            parts,
        )

    def close(self) -> None:
        for _, region in self.regions():
            region.close()


def _hot_prefix(entry: dict[str, Any]) -> HotPrefix:
    return HotPrefix(
        Identity.from_dict(entry["identity"]),
        np.frombuffer(entry["tokens"], dtype="<u4"),
        tuple(np.frombuffer(entry["sizes"], "<u8").tolist()),
        float(entry["score"]),
    )


def _check(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok") is not True:
        error = reply.get("error") or {}
        raise error_for(str(error.get("code", "unknown")), str(error.get("message", "")))
    return reply


class Client:
    """Blocking client: one request at a time on one connection (~tens of microseconds each)."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        region_bytes: int = 0,
        token_region_bytes: int = 4 << 20,
        timeout: float = 30.0,
        name: str = "prefixd-client",
        serves: Sequence[tuple[str, str]] = (),
    ) -> None:
        """`region_bytes`: the shared region payloads are staged in and loaded into (0: none,
        for lookups only). `token_region_bytes`: where long prompts' token ids are staged.
        `serves`: (model, weights) pairs this engine serves; on connecting, the daemon retires
        the other stored versions of those models."""
        self.socket_path = Path(socket_path)
        self.serves = [{"model": m, "weights": w} for m, w in serves]
        self.timeout = timeout
        self.name = name
        self.server: dict[str, Any] = {}
        self._requests = _Requests(region_bytes, token_region_bytes)
        self._sock: socket.socket | None = None
        self._header = bytearray(HEADER.size)
        self._publisher: Publisher | None = None
        try:
            self._connect()
        except BaseException:
            self._requests.close()
            raise

    @property
    def region(self) -> SharedRegion | None:
        return self._requests.region

    def put(
        self,
        identity: Identity,
        token_ids: TokenIds,
        payloads: Sequence[Any],
        *,
        first_block: int = 0,
    ) -> Stored:
        """Stage `payloads` in the region and publish blocks first_block.. of `token_ids`."""
        spans = self._requests.stage(payloads)
        reply = self._call(self._requests.put(identity, token_ids, spans, first_block))
        return Stored(reply["stored"], reply["existed"])

    def put_spans(
        self,
        identity: Identity,
        token_ids: TokenIds,
        spans: Sequence[tuple[int, int]],
        *,
        first_block: int = 0,
    ) -> Stored:
        """Publish payloads the engine already wrote into the region at (offset, length) spans."""
        self._requests.require_region()
        named = [[self._requests.region_id, o, n] for o, n in spans]
        reply = self._call(self._requests.put(identity, token_ids, named, first_block))
        return Stored(reply["stored"], reply["existed"])

    def lookup(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        *,
        hashes: Sequence[bytes | None] | None = None,
    ) -> list[Lookup]:
        """The stored prefix of each prompt (one round trip for the whole batch)."""
        return _Requests.lookups(self._call(self._requests.lookup(identity, prompts, hashes)))

    def load(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        offset: int = 0,
        length: int | None = None,
        max_blocks: int | None = None,
        hashes: bytes | None = None,
        first_block: int = 0,
        warm: bool = False,
    ) -> Loaded:
        """Load the longest stored prefix of `token_ids` (from `first_block` on) into the region
        at `offset`. `warm` counts the load as restart warm-up in the daemon's stats."""
        message = self._requests.load(
            identity, token_ids, offset, length, max_blocks, hashes, first_block, warm
        )
        return self._requests.loaded(self._call(message))

    def hot(self, budget_bytes: int, *, tenant: str, limit: int = 64) -> list[HotPrefix]:
        """The tenant's most valuable stored prefixes (by the eviction score) within
        `budget_bytes`."""
        message = {"op": "hot", "budget_bytes": budget_bytes, "tenant": tenant, "limit": limit}
        reply = self._call(message)
        return [_hot_prefix(p) for p in reply["prefixes"]]

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
        staged = self._requests.stage_state(paged or {}, checkpoints or {})
        message = self._requests.put_state(identity, token_ids, *staged, upto_tokens, first_block)
        reply = self._call(message)
        return Stored(reply["stored"], reply["existed"], reply["parts"])

    def lookup_state(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        *,
        hashes: Sequence[bytes | None] | None = None,
    ) -> list[StateLookup]:
        """The joint hit of each prompt for a hybrid identity (one round trip)."""
        message = {**self._requests.lookup(identity, prompts, hashes), "op": "lookup_state"}
        return [self._requests.state(r) for r in self._call(message)["results"]]

    def load_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        offset: int = 0,
        length: int | None = None,
    ) -> StateLoaded:
        """Load every verified payload of the joint hit into the region at `offset`; each part's
        `view` holds its bytes (valid until the region is reused or closed)."""
        message = self._requests.load_state(identity, token_ids, offset, length)
        return self._requests.state(self._call(message), loaded=True)

    def purge(self, *, dry_run: bool = False, **criteria: Any) -> dict[str, Any]:
        """Remove entries by tenant, model version or age (see PurgeSelector); the counts."""
        return self._call({"op": "purge", "dry_run": dry_run, **criteria})

    def stats(self) -> dict[str, Any]:
        return self._call({"op": "stats"})

    def verify(self, *, fix: bool = False, payloads: bool = True) -> dict[str, Any]:
        """Check (or with `fix`, repair) the store the daemon serves; the report."""
        reply = self._call({"op": "verify", "fix": fix, "payloads": payloads})
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def health(self) -> dict[str, Any]:
        return self._call({"op": "health"})

    # --- into and out of device memory (prefixd.transfer; needs torch) -------------------------

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
        device, one per block) through the region's staging slots; see prefixd.transfer."""
        from prefixd.transfer import load_into

        return load_into(
            self, identity, token_ids, destinations, slots=slots, wait=wait, hashes=hashes
        )

    def load_state_into(
        self,
        identity: Identity,
        token_ids: TokenIds,
        destinations: Mapping[str, Sequence[Any]],
        *,
        wait: bool = True,
    ) -> InstalledState:
        """A hybrid identity's joint hit into per-group destination tensors."""
        from prefixd.transfer import load_state_into

        return load_state_into(self, identity, token_ids, destinations, wait=wait)

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
        """Publish blocks from device tensors in the background (their own connection and
        region of at least `region_bytes`); the future resolves when they are stored."""
        from prefixd.transfer import Publisher

        if self._publisher is not None and self._publisher.region_bytes < region_bytes:
            self._publisher.close()  # waits for the stores under way, then makes room
            self._publisher = None
        if self._publisher is None:
            self._publisher = Publisher(self, region_bytes)
        return self._publisher.store_from(
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
        from prefixd.transfer import warm_up

        return warm_up(
            self, budget_bytes, destinations_factory, tenant=tenant, limit=limit, slots=slots
        )

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        self._drop()
        self._requests.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- transport ------------------------------------------------------------------------------

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(os.fspath(self.socket_path))
        except OSError as exc:
            sock.close()
            raise DaemonUnavailableError(f"cannot connect to {self.socket_path}: {exc}") from None
        self._sock = sock
        try:
            hello: dict[str, Any] = {
                "op": "hello",
                "protocol": PROTOCOL_VERSION,
                "client": self.name,
            }
            if self.serves:
                hello["serves"] = self.serves
            self.server = self._roundtrip(hello)
            for attribute, region in self._requests.regions():
                reply = self._roundtrip({"op": "attach", "size": region.size}, fds=[region.fd])
                setattr(self._requests, attribute, reply["region"])
        except BaseException:
            self._sock = None
            sock.close()
            raise

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request; after a broken connection, reconnect and retry once."""
        self._requests.begin()
        if self._sock is None:
            self._connect()
            return self._roundtrip(message)
        try:
            return self._roundtrip(message)
        except ConnectionError:
            self._drop()
            self._connect()  # DaemonUnavailableError if the daemon is not back
            return self._roundtrip(message)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _roundtrip(self, message: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        assert self._sock is not None
        rid = self._requests.next_id()
        frame = encode_frame({**message, "id": rid})
        try:
            if fds:
                send_with_fds(self._sock, frame, fds)
            else:
                self._sock.sendall(frame)
            while True:
                reply = self._receive()
                if reply.get("id") == rid:
                    return _check(reply)
                if reply.get("id") is None:
                    _check(reply)  # a connection-level error addressed to no request
        except TimeoutError:
            self._drop()  # the reply may still come: this connection is out of step
            raise
        except ConnectionError:
            raise
        except OSError as exc:
            raise ConnectionError(str(exc)) from exc

    def _receive(self) -> dict[str, Any]:
        assert self._sock is not None
        self._recv_exact(memoryview(self._header))
        (length,) = HEADER.unpack(self._header)
        body = bytearray(length)
        self._recv_exact(memoryview(body))
        return decode_body(body)

    def _recv_exact(self, view: memoryview) -> None:
        assert self._sock is not None
        while len(view):
            got = self._sock.recv_into(view)
            if not got:
                raise ConnectionError("the daemon closed the connection")
            view = view[got:]


class AsyncClient:
    """asyncio client: many requests in flight on one connection, replies matched by id."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        region_bytes: int = 0,
        timeout: float = 30.0,
        name: str = "prefixd-async-client",
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.name = name
        self.server: dict[str, Any] = {}
        self._requests = _Requests(region_bytes)
        self._sock: socket.socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._write_lock = asyncio.Lock()
        self._connect_lock = asyncio.Lock()
        self._put_lock = asyncio.Lock()  # puts stage at the region's start: one at a time

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str], **options: Any) -> AsyncClient:
        client = cls(socket_path, **options)
        try:
            await client._connect()
        except BaseException:
            await client.close()
            raise
        return client

    @property
    def region(self) -> SharedRegion | None:
        return self._requests.region

    async def put(
        self,
        identity: Identity,
        token_ids: TokenIds,
        payloads: Sequence[Any],
        *,
        first_block: int = 0,
    ) -> Stored:
        async with self._put_lock:
            spans = self._requests.stage(payloads)
            reply = await self._call(self._requests.put(identity, token_ids, spans, first_block))
        return Stored(reply["stored"], reply["existed"])

    async def lookup(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        *,
        hashes: Sequence[bytes | None] | None = None,
    ) -> list[Lookup]:
        return _Requests.lookups(await self._call(self._requests.lookup(identity, prompts, hashes)))

    async def load(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        offset: int = 0,
        length: int | None = None,
        max_blocks: int | None = None,
        hashes: bytes | None = None,
    ) -> Loaded:
        message = self._requests.load(identity, token_ids, offset, length, max_blocks, hashes)
        return self._requests.loaded(await self._call(message))

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
        async with self._put_lock:
            staged = self._requests.stage_state(paged or {}, checkpoints or {})
            message = self._requests.put_state(
                identity, token_ids, *staged, upto_tokens, first_block
            )
            reply = await self._call(message)
        return Stored(reply["stored"], reply["existed"], reply["parts"])

    async def lookup_state(
        self,
        identity: Identity,
        prompts: Sequence[TokenIds],
        *,
        hashes: Sequence[bytes | None] | None = None,
    ) -> list[StateLookup]:
        message = {**self._requests.lookup(identity, prompts, hashes), "op": "lookup_state"}
        return [self._requests.state(r) for r in (await self._call(message))["results"]]

    async def load_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        offset: int = 0,
        length: int | None = None,
    ) -> StateLoaded:
        message = self._requests.load_state(identity, token_ids, offset, length)
        return self._requests.state(await self._call(message), loaded=True)

    async def purge(self, *, dry_run: bool = False, **criteria: Any) -> dict[str, Any]:
        return await self._call({"op": "purge", "dry_run": dry_run, **criteria})

    async def stats(self) -> dict[str, Any]:
        return await self._call({"op": "stats"})

    async def health(self) -> dict[str, Any]:
        return await self._call({"op": "health"})

    async def close(self) -> None:
        self._disconnect(DaemonUnavailableError("client closed"))
        self._requests.close()

    async def __aenter__(self) -> AsyncClient:
        if self._sock is None:
            await self._connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- transport ------------------------------------------------------------------------------

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(
                loop.sock_connect(sock, os.fspath(self.socket_path)), self.timeout
            )
        except (TimeoutError, OSError) as exc:
            sock.close()
            raise DaemonUnavailableError(f"cannot connect to {self.socket_path}: {exc}") from None
        self._sock = sock
        self._reader = asyncio.create_task(self._read_replies(sock))
        hello = {"op": "hello", "protocol": PROTOCOL_VERSION, "client": self.name}
        self.server = await self._roundtrip(hello)
        for attribute, region in self._requests.regions():
            reply = await self._roundtrip({"op": "attach", "size": region.size}, fds=[region.fd])
            setattr(self._requests, attribute, reply["region"])

    async def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            if self._sock is None:
                async with self._connect_lock:
                    if self._sock is None:
                        await self._connect()
            return await self._roundtrip(message)
        except ConnectionError:
            async with self._connect_lock:
                if self._sock is None:
                    await self._connect()
            return await self._roundtrip(message)

    async def _roundtrip(self, message: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        sock = self._sock
        if sock is None:
            raise ConnectionError("not connected")
        loop = asyncio.get_running_loop()
        rid = self._requests.next_id()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[rid] = future
        frame = encode_frame({**message, "id": rid})
        try:
            async with self._write_lock:
                if fds:
                    sock.setblocking(True)  # a short frame with a descriptor: send it whole
                    try:
                        send_with_fds(sock, frame, fds)
                    finally:
                        sock.setblocking(False)
                else:
                    await loop.sock_sendall(sock, frame)
            return _check(await asyncio.wait_for(future, self.timeout))
        except OSError as exc:
            self._disconnect(exc)
            raise ConnectionError(str(exc)) from exc
        finally:
            self._pending.pop(rid, None)

    async def _read_replies(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        header = bytearray(HEADER.size)
        try:
            while True:
                await _recv_exact(loop, sock, memoryview(header))
                (length,) = HEADER.unpack(header)
                body = bytearray(length)
                await _recv_exact(loop, sock, memoryview(body))
                reply = decode_body(body)
                future = self._pending.get(reply.get("id"))  # type: ignore[arg-type]
                if future is not None and not future.done():
                    future.set_result(reply)
        except (OSError, PrefixdError) as exc:
            if self._sock is sock:
                self._disconnect(ConnectionError(f"connection lost: {exc}"))

    def _disconnect(self, reason: BaseException) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError(str(reason)))
        self._pending.clear()


async def _recv_exact(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
) -> None:
    while len(view):
        got = await loop.sock_recv_into(sock, view)
        if not got:
            raise ConnectionError("the daemon closed the connection")
        view = view[got:]
