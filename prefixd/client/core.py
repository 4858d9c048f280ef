"""The client's protocol core, without I/O: its regions, request ids, the daemon's greeting, and
the pieces requests are made of. The operations are steps on it (prefixd.client.operations).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeAlias, TypeVar

import msgspec
import numpy as np

from prefixd.client.leases import Lease, RegionAllocator, Span
from prefixd.client.steps import Call, Reserve, Steps, holding, spans_of
from prefixd.errors import DaemonUnavailableError, PrefixdError, RegionError
from prefixd.schema.content import chain_words
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import PromptIds, TokenIds, as_token_array
from prefixd.trust import daemon_uids
from prefixd.wire import decoding
from prefixd.wire import messages as wire
from prefixd.wire.errors import error_for
from prefixd.wire.frames import PROTOCOL_VERSION, decode_body, encode_frame
from prefixd.wire.region import SharedRegion

INLINE_TOKEN_BYTES = 16 << 10  # longer prompts go through the token region, not the socket

P = ParamSpec("P")
T = TypeVar("T")


class ClientCore:
    """A client's state apart from its socket: regions, request ids, the daemon's greeting."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        region_bytes: int,
        token_region_bytes: int,
        timeout: float,
        name: str,
        serves: Sequence[tuple[str, str]] = (),
        reconnect_wait_s: float = 0.0,
        daemon_uid: int | str | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.daemon_uids = daemon_uids(daemon_uid)  # who may serve the socket (prefixd.trust)
        self.timeout = timeout
        self.name = name
        self.serves = [wire.Served(model=m, weights=w) for m, w in serves]
        self.reconnect_wait_s = reconnect_wait_s
        self.server: dict[str, Any] = {}
        self.instance: str | None = None
        self.region = SharedRegion(region_bytes) if region_bytes else None
        try:
            self.token_region = (
                SharedRegion(token_region_bytes, name="prefixd-tokens")
                if token_region_bytes
                else None
            )
        except BaseException:
            if self.region is not None:
                self.region.close()
            raise
        self.payloads = RegionAllocator(self.region) if self.region else None
        self.tokens = (
            RegionAllocator(self.token_region, name="token region") if self.token_region else None
        )
        self._region_ids: dict[int, int] = {}  # id(allocator) -> the daemon's region id
        self._ids = itertools.count(1)
        self._identities: dict[int, tuple[Identity, wire.WireIdentity]] = {}

    # --- the conversation -----------------------------------------------------------------------

    def next_id(self) -> int:
        return next(self._ids)

    def allocators(self) -> list[RegionAllocator]:
        return [a for a in (self.payloads, self.tokens) if a is not None]

    def greeting(self) -> Generator[Call, Any, None]:
        """What a fresh connection sends first: hello, then one attach per region."""
        hello = wire.Hello(
            id=self.next_id(),
            protocol=PROTOCOL_VERSION,
            client=self.name,
            serves=self.serves or None,
        )
        server: wire.HelloReply = yield Call(hello)
        instance = server.instance or None
        if self.instance is not None and instance != self.instance:
            for allocator in self.allocators():  # the daemon that had lost requests is gone
                allocator.daemon_restarted()
        self.instance = instance
        self.server = msgspec.structs.asdict(server)
        for allocator in self.allocators():
            region = allocator.region
            attach = wire.Attach(id=self.next_id(), size=region.size)
            attached: wire.AttachReply = yield Call(attach, fds=(region.fd,))
            self._region_ids[id(allocator)] = attached.region

    def frame(self, message: wire.RequestMessage | dict[str, Any]) -> tuple[int, bytes]:
        """A request's id and its whole frame."""
        if isinstance(message, dict):
            rid = self.next_id()
            return rid, encode_frame({**message, "id": rid})
        return message.id, encode_frame(message)

    @staticmethod
    def reply(message: wire.RequestMessage | dict[str, Any], body: memoryview) -> Any:
        """The reply to `message` in `body` (a map for a raw message); an error reply raises."""
        if isinstance(message, dict):
            return ClientCore.check(decode_body(body))
        return decoding.decode_reply(body, wire.REPLY_OF[type(message)])

    @staticmethod
    def reply_if_for(
        message: wire.RequestMessage | dict[str, Any], rid: int, body: memoryview
    ) -> tuple[bool, Any]:
        """(True, the reply) when `body` answers request `rid`, else (False, None); one decode
        on the usual path."""
        if not isinstance(message, dict):
            try:
                reply = decoding.decode_reply(body, wire.REPLY_OF[type(message)])
            except PrefixdError:
                if decoding.reply_id(body) == rid:
                    raise
                return False, None
            return reply.id == rid, reply
        if decoding.reply_id(body) != rid:
            return False, None
        return True, ClientCore.check(decode_body(body))

    @staticmethod
    def check(reply: dict[str, Any]) -> dict[str, Any]:
        """The reply, or its error raised as the error's class."""
        if reply.get("ok") is not True:
            error = reply.get("error") or {}
            raise error_for(str(error.get("code", "unknown")), str(error.get("message", "")))
        return reply

    def lost_with_spans(self, reason: BaseException) -> None:
        """The connection broke with requests naming region spans in flight: wake every waiter
        for space with the reason, since those spans may be what it waits for."""
        for allocator in self.allocators():
            allocator.interrupt(DaemonUnavailableError(f"{reason} (while waiting for space)"))

    def close(self) -> None:
        for region in (self.region, self.token_region):
            if region is not None:
                region.close()

    # --- request pieces -------------------------------------------------------------------------

    def wire_identity(self, identity: Identity) -> wire.WireIdentity:
        cached = self._identities.get(id(identity))
        if cached is None or cached[0] is not identity:
            cached = (identity, wire.WireIdentity.of(identity))
            if len(self._identities) >= 256:
                self._identities.clear()
            self._identities[id(identity)] = cached
        return cached[1]

    def require_payloads(self) -> RegionAllocator:
        if self.payloads is None:
            raise PrefixdError("this client has no shared region: pass region_bytes")
        return self.payloads

    def region_id(self, allocator: RegionAllocator) -> int:
        return self._region_ids[id(allocator)]

    def prompt_fields(self, words: TokenIds, held: list[Lease | Span]) -> dict[str, Any]:
        """A prompt's token fields (its chain words): staged in a span of the token region when
        long and there is room now (the span goes to `held`), else inline in the frame."""
        entry = self._entry(words, None, held)
        return {
            "tokens": entry.tokens,
            "tokens_span": entry.tokens_span,
            "n_tokens": entry.n_tokens,
        }

    def _entry(
        self, words: TokenIds, hashes: bytes | None, held: list[Lease | Span]
    ) -> wire.Prompt:
        """One prompt of a request (its chain words: prefixd.schema.content.chain_words); a
        token-region span it stages them in goes to `held`."""
        tokens = as_token_array(words)
        allocator = self.tokens
        span = None
        if allocator is not None and tokens.nbytes >= INLINE_TOKEN_BYTES:
            span = allocator.try_span(tokens.nbytes)
        if span is None:
            return wire.Prompt(tokens=tokens.tobytes(), n_tokens=len(tokens), hashes=hashes)
        held.append(span)
        span.write(tokens)
        where = (self._region_ids[id(allocator)], span.offset, len(tokens))
        return wire.Prompt(tokens_span=where, n_tokens=len(tokens), hashes=hashes)

    def stage(self, payloads: Sequence[Any], held: list[Lease | Span]) -> Steps[list[wire.Span]]:
        """Lease room for `payloads` (the lease goes to `held`) and copy them in back to back;
        the spans a put names."""
        allocator = self.require_payloads()
        region_id = self.region_id(allocator)
        sources = [np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in payloads]
        total = sum(s.nbytes for s in sources)
        if total == 0:
            return [(region_id, 0, 0) for _ in sources]
        lease: Lease = yield Reserve(allocator, total)
        held.append(lease)
        spans: list[wire.Span] = []
        offset = 0
        for source in sources:
            lease.write(source, offset)
            spans.append((region_id, lease.offset + offset, source.nbytes))
            offset += source.nbytes
        return spans

    def prompts_call(
        self,
        kind: type[wire.Prompts],
        identity: Identity,
        prompts: Sequence[PromptIds],
        hashes: Sequence[bytes | None] | None = None,
        **fields: Any,
    ) -> Steps[Any]:
        """Send a request of `kind` about `prompts` (and its other `fields`) and return its
        reply, holding the token-region spans the prompts were staged in until it is in."""
        with holding() as held:
            entries = [
                self._entry(
                    chain_words(identity, prompt), None if hashes is None else hashes[i], held
                )
                for i, prompt in enumerate(prompts)
            ]
            message = kind(
                id=self.next_id(), identity=self.wire_identity(identity), prompts=entries, **fields
            )
            reply = yield Call(message, spans_of(held))
        return reply

    def prompted_call(
        self,
        kind: type[wire.Prompted],
        identity: Identity,
        token_ids: PromptIds,
        spans: Sequence[Span] = (),
        *,
        owned: bool = True,
        **fields: Any,
    ) -> Steps[Any]:
        """Send a request of `kind` about one prompt (and its other `fields`), naming `spans`
        (see Call), and return its reply; a token-region span is held until it is in."""
        with holding() as held:
            message = kind(
                id=self.next_id(),
                identity=self.wire_identity(identity),
                **self.prompt_fields(chain_words(identity, token_ids), held),
                **fields,
            )
            reply = yield Call(message, (*spans, *spans_of(held)), owned=owned)
        return reply

    # --- the load every load is made of ----------------------------------------------------------

    def load_span(
        self,
        identity: Identity,
        token_ids: PromptIds,
        lease: Lease,
        start: int,
        length: int,
        *,
        max_blocks: int | None = None,
        hashes: bytes | None = None,
        first_block: int = 0,
        warm: bool = False,
        deadline_s: float | None = None,
    ) -> Steps[wire.LoadReply]:
        """Load into bytes [start, start + length) of a lease the caller holds."""
        if not 0 <= start <= start + length <= lease.size or lease.released:
            raise RegionError(f"[{start}, {start + length}) is not inside a held lease")
        reply: wire.LoadReply = yield from self.prompted_call(
            wire.Load,
            identity,
            token_ids,
            (lease.span,),
            hashes=hashes,
            region=self.region_id(self.require_payloads()),
            offset=lease.offset + start,
            length=length,
            max_blocks=max_blocks,
            first_block=first_block or None,
            warm=warm or None,
            deadline_s=deadline_s,
        )
        return reply


# What each operation is declared as (prefixd.client.operations): a function of the core that
# makes its steps, and what a shell's `run` takes.
StepsOf: TypeAlias = Callable[Concatenate[ClientCore, P], Steps[T]]
