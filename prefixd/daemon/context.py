"""What a request's handler is given (a RequestContext: the daemon's Services, the Peer that asked,
the checks of a request's fields) and what a handler is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from msgspec import Struct

from prefixd.daemon.fields import request_tokens, token_count
from prefixd.daemon.peer import Peer
from prefixd.daemon.services import Query, Services
from prefixd.errors import ProtocolError
from prefixd.schema.identity import Identity
from prefixd.wire.errors import ErrorCode
from prefixd.wire.messages import Prompts, RequestMessage, TokenFields, WireIdentity

M_co = TypeVar("M_co", bound=RequestMessage, covariant=True)
# A lookup's reply names 8 bytes per hit block: 4M blocks stay within what a client reads as one
# reply (MAX_REPLY_BYTES), however often a request names the same prompt.
MAX_REQUEST_BLOCKS = 4 << 20
# A reply: a struct of prefixd.wire.messages, or a map of the same fields (verify's report)
AnyReply = Struct | dict[str, Any]


class Request(NamedTuple, Generic[M_co]):
    """A decoded request and the descriptors that arrived with its frame."""

    id: int
    message: M_co
    fds: tuple[int, ...] = ()


class Queries(NamedTuple):
    """A request's prompts, read once: their identity, and each one's tokens and hashes."""

    identity: Identity
    prompts: list[Query]


class Answered(NamedTuple):
    """A reply computed on the event loop, and what to count once it is sent."""

    reply: Struct
    after: Callable[[], None] | None = None


Later = Callable[[], Awaitable[AnyReply]]  # the work of a request a task runs


@dataclass(frozen=True)
class Handler:
    """`now` answers on the loop what needs no worker, else returns the work for a task;
    `takes_fds`: the frame's descriptors are the request's (else closed); `before_hello`,
    `while_stopping`: taken before hello, and while the daemon shuts down."""

    run: Callable[[RequestContext, Request[Any]], Awaitable[AnyReply]]
    now: Callable[[RequestContext, Request[Any]], Answered | Later] | None = None
    takes_fds: bool = False
    before_hello: bool = False
    while_stopping: bool = False


@dataclass(frozen=True)
class RequestContext:
    services: Services
    peer: Peer

    def require_tenant(self, tenant: str) -> None:
        if not self.peer.grant.may_use(tenant):
            raise ProtocolError(
                ErrorCode.FORBIDDEN, f"uid {self.peer.uid} may not use tenant {tenant!r}"
            )

    def require_op(self, op: str, *, every_tenant: bool = False) -> None:
        """Refuse an administrative operation the grant does not name (or one reaching every tenant,
        for a peer limited to some)."""
        grant = self.peer.grant
        if not grant.may_run(op) or (every_tenant and grant.tenants is not None):
            scope = " for every tenant" if every_tenant else ""
            raise ProtocolError(ErrorCode.FORBIDDEN, f"uid {self.peer.uid} may not run {op}{scope}")

    def identity(self, wire: WireIdentity) -> Identity:
        """The identity a request names, if the peer may use its tenant."""
        self.require_tenant(wire.tenant)
        return self.services.identity(wire)

    def prompt(self, fields: TokenFields) -> bytes | memoryview:
        token_count(fields, self.services.max_prompt_tokens)
        return request_tokens(self.peer, fields)

    def queries(self, msg: Prompts) -> Queries:
        """A request's prompts, within max_prompt_tokens each, max_request_tokens together and
        MAX_REQUEST_BLOCKS closed blocks together."""
        identity = self.identity(msg.identity)
        most, total_most = self.services.max_prompt_tokens, self.services.max_request_tokens
        counts = [
            token_count(prompt, most, f"prompts[{i}].") for i, prompt in enumerate(msg.prompts)
        ]
        total, blocks = sum(counts), sum(count // identity.block_words for count in counts)
        if total > total_most:
            raise ProtocolError(
                ErrorCode.BAD_TOKENS,
                f"the prompts hold {total} token ids together, at most {total_most} "
                "per request (max_request_tokens)",
            )
        if blocks > MAX_REQUEST_BLOCKS:
            raise ProtocolError(
                ErrorCode.BAD_TOKENS,
                f"the prompts hold {blocks} closed blocks together, at most "
                f"{MAX_REQUEST_BLOCKS} per request",
            )
        prompts = [
            (request_tokens(self.peer, prompt, f"prompts[{i}]."), prompt.hashes)
            for i, prompt in enumerate(msg.prompts)
        ]
        return Queries(identity, prompts)
