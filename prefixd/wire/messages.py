"""Every message on the wire as a typed msgspec struct: requests tagged by `op`, replies untagged.

msgpack stays the format, so a peer that builds plain maps is understood: optional fields have
defaults (nil counts as absent) and unknown fields are ignored (docs/protocol.md, "Evolution
rules"), except in an identity, whose every field is part of the cache key. Every array, map and
string carries a length bound (`MAX_*`) and no field is typed `Any`, so the schema bounds what a
request can make the daemon build (prefixd.wire.decoding reads it).
"""

from typing import Annotated, Any, Protocol, TypeAlias, get_args

import msgspec
from msgspec import Meta, Struct

from prefixd.schema.identity import (
    MAX_BLOCK_TOKENS,
    MAX_FIELD_BYTES,
    MAX_KEY_BYTES,
    MIN_KEY_BYTES,
    Identity,
)
from prefixd.schema.state import MAX_GROUP_NAME_BYTES, MAX_GROUPS, MAX_PAGE_BLOCKS, StateGroup
from prefixd.wire.errors import ErrorCode

# --- limits -------------------------------------------------------------------------------------

MAX_ID = (1 << 63) - 1  # request ids: non-negative int64
MAX_INT = 1 << 62  # counts, offsets, lengths, boundaries
MAX_PROTOCOL = 1 << 31
MAX_REGION_ID = 1 << 31
MAX_TEXT = MAX_FIELD_BYTES  # characters of a free-text field (an identity field: bytes too)
MAX_NAME = 64  # a state group's name and kind, a kept version's field name
MAX_PROMPTS_PER_LOOKUP = 4096
MAX_BLOCKS_PER_PUT = 1 << 16  # put: blocks; put_state: payloads of one group (and in all)
MAX_HOT_PREFIXES = 4096
MAX_SERVES = 1024  # hello's served (model, weights) versions
MAX_KEPT = 16  # purge's kept versions (one per versioned identity field)
MAX_QUOTED = 64  # characters of a client's field or op name quoted back in an error

# --- field types --------------------------------------------------------------------------------

Id = Annotated[int, Meta(ge=0, le=MAX_ID)]
Count = Annotated[int, Meta(ge=0, le=MAX_INT)]
SpanInt = Annotated[int, Meta(ge=0, lt=MAX_INT)]
Span = tuple[SpanInt, SpanInt, SpanInt]  # [region, offset, length]; tokens_span: n_tokens
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Required = Annotated[str, Meta(min_length=1, max_length=MAX_TEXT)]  # a non-empty Text
Name = Annotated[str, Meta(max_length=MAX_NAME)]
GroupName = Annotated[str, Meta(max_length=MAX_GROUP_NAME_BYTES)]


# --- the identity -------------------------------------------------------------------------------


class WireStateGroup(Struct, frozen=True, forbid_unknown_fields=True):
    """One group of a hybrid identity's state spec (prefixd.schema.state.StateGroup)."""

    name: Annotated[str, Meta(min_length=1, max_length=MAX_GROUP_NAME_BYTES)]
    kind: Name
    page_blocks: Annotated[int, Meta(ge=1, le=MAX_PAGE_BLOCKS)] = 1
    policy: Name = "chosen"
    period_tokens: Count = 0
    replay_tokens: Count = 0


class WireIdentity(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """prefixd.Identity on the wire (its `to_dict()`): a map of scalar fields and an optional
    state spec. Frozen, so the daemon keys its cache of parsed identities by it. Unset optional
    fields are left out, so a daemon that predates one (`key_bytes`) still reads the rest."""

    model: Required
    weights: Required
    tokenizer: Required
    template: Required
    rope: Required
    kv_layout: Required
    block_tokens: Annotated[int, Meta(ge=1, le=MAX_BLOCK_TOKENS)]
    tenant: Required
    adapter: Required | None = None
    mm: Required | None = None
    state: (
        Annotated[tuple[WireStateGroup, ...], Meta(min_length=1, max_length=MAX_GROUPS)] | None
    ) = None
    key_bytes: Annotated[int, Meta(ge=MIN_KEY_BYTES, le=MAX_KEY_BYTES, multiple_of=4)] | None = None
    request_content: bool = False

    @classmethod
    def of(cls, identity: Identity) -> "WireIdentity":
        fields = _fields(identity, cls)
        if identity.state is not None:
            fields["state"] = tuple(
                WireStateGroup(**_fields(g, WireStateGroup)) for g in identity.state
            )
        return cls(**fields)

    def to_identity(self) -> Identity:
        """The identity; raises IdentityError for what the schema cannot say (a string's bytes,
        a state spec that does not fit the block size, ...)."""
        fields = _fields(self, WireIdentity)
        if self.state is not None:
            fields["state"] = tuple(StateGroup(**_fields(g, WireStateGroup)) for g in self.state)
        return Identity(**fields)


def _fields(source: object, kind: type[Struct]) -> dict[str, Any]:
    """`source`'s values of the fields `kind` has (an identity's or a state group's)."""
    return {name: getattr(source, name) for name in kind.__struct_fields__}


# --- requests -----------------------------------------------------------------------------------


class RequestMessage(Struct, tag_field="op", kw_only=True, omit_defaults=True):
    """A request: `id` (chosen by the client, echoed in the reply) and, as the tag, `op`. Fields
    left at their defaults are not sent (absent and nil mean the same to a daemon)."""

    id: Id


class TokenFields(Protocol):
    """A prompt's token ids: inline `tokens` (packed u32 LE) or `tokens_span` ([region, offset,
    n_tokens] in a shared region), exactly one of them; `n_tokens`, when given, must agree."""

    @property
    def tokens(self) -> bytes | None: ...

    @property
    def tokens_span(self) -> Span | None: ...

    @property
    def n_tokens(self) -> int | None: ...


class Served(Struct, kw_only=True):
    """A model version an engine serves (hello's `serves`)."""

    model: Required
    weights: Required


class Hello(RequestMessage, tag="hello", kw_only=True):
    protocol: Annotated[int, Meta(ge=0, le=MAX_PROTOCOL)]
    client: Text | None = None
    serves: Annotated[list[Served], Meta(max_length=MAX_SERVES)] | None = None


class Attach(RequestMessage, tag="attach", kw_only=True):
    """Sent with one memfd as SCM_RIGHTS."""

    size: Annotated[int, Meta(ge=1, le=MAX_INT)]


class Prompt(Struct, kw_only=True, omit_defaults=True):
    """One prompt of a lookup."""

    tokens: bytes | None = None
    tokens_span: Span | None = None
    n_tokens: Count | None = None
    hashes: bytes | None = None


class Prompted(RequestMessage, kw_only=True):
    """A request about one prompt of one identity: its token fields (see TokenFields)."""

    identity: WireIdentity
    tokens: bytes | None = None
    tokens_span: Span | None = None
    n_tokens: Count | None = None


class Prompts(RequestMessage, kw_only=True):
    """A request about a batch of prompts of one identity."""

    identity: WireIdentity
    prompts: Annotated[list[Prompt], Meta(max_length=MAX_PROMPTS_PER_LOOKUP)]


class Put(Prompted, tag="put", kw_only=True):
    first_block: Count | None = None  # default 0
    blocks: Annotated[list[Span], Meta(max_length=MAX_BLOCKS_PER_PUT)]


# tokens/s: the prefill throughput the engine measured, for the benefit rule (default: the
# tenant's last reported, else the daemon's prefill_tokens_per_s)
PrefillRate = Annotated[float, Meta(gt=0.0, le=1e12)]


class Lookup(Prompts, tag="lookup", kw_only=True):
    pin: bool | None = None  # default false: pin each hit's blocks for this connection
    prefill_tokens_per_s: PrefillRate | None = None
    # default false: true asks what is stored, whether or not loading it pays (no benefit rule)
    stored_only: bool | None = None


class Unpin(Prompts, tag="unpin", kw_only=True):
    """Release one of this connection's pins of each closed block of each prompt."""


class Delete(Prompts, tag="delete", kw_only=True):
    """Remove the last closed block of each prompt, and every block below it."""


class Load(Prompted, tag="load", kw_only=True):
    hashes: bytes | None = None
    region: Annotated[int, Meta(ge=0, le=MAX_REGION_ID)]
    offset: Count | None = None  # default 0
    length: Count | None = None  # default: to the region's end
    max_blocks: Count | None = None
    first_block: Count | None = None  # default 0
    warm: bool | None = None  # default false
    # seconds from arrival after which the daemon stops reading and answers the verified prefix
    # (default: its load_deadline_s; 0 there: none)
    deadline_s: Annotated[float, Meta(gt=0.0, le=86400.0)] | None = None


class Stats(RequestMessage, tag="stats", kw_only=True):
    pass


class Health(RequestMessage, tag="health", kw_only=True):
    pass


class Purge(RequestMessage, tag="purge", kw_only=True):
    tenant: Text | None = None
    model: Text | None = None
    keep: Annotated[dict[Name, Text | None], Meta(max_length=MAX_KEPT)] | None = None
    older_than_s: float | None = None
    everything: bool | None = None  # default false
    dry_run: bool | None = None  # default false


# A put_state's payloads of one group: spans of a paged group, (boundary, span) of a checkpoint
# group. All groups together hold at most MAX_BLOCKS_PER_PUT (decode_request counts them first).
PagedSpans = Annotated[list[Span], Meta(max_length=MAX_BLOCKS_PER_PUT)]
CheckpointSpans = Annotated[list[tuple[Count, Span]], Meta(max_length=MAX_BLOCKS_PER_PUT)]


class PutState(Prompted, tag="put_state", kw_only=True):
    first_block: Count | None = None  # default 0
    upto_tokens: Count | None = None  # default: every token given
    paged: Annotated[dict[GroupName, PagedSpans], Meta(max_length=MAX_GROUPS)] | None = None
    checkpoints: Annotated[dict[GroupName, CheckpointSpans], Meta(max_length=MAX_GROUPS)] | None = (
        None
    )


class LookupState(Prompts, tag="lookup_state", kw_only=True):
    prefill_tokens_per_s: PrefillRate | None = None


class LoadState(Prompted, tag="load_state", kw_only=True):
    hashes: bytes | None = None
    region: Annotated[int, Meta(ge=0, le=MAX_REGION_ID)]
    offset: Count | None = None
    length: Count | None = None
    # as Load's; a state cut off at its deadline is a miss (it needs every group)
    deadline_s: Annotated[float, Meta(gt=0.0, le=86400.0)] | None = None


class Route(Prompted, tag="route", kw_only=True):
    """What this node would serve the prompt and at what cost (no payload is read)."""

    hashes: bytes | None = None


class Hot(RequestMessage, tag="hot", kw_only=True):
    budget_bytes: Count
    tenant: Text
    limit: Annotated[int, Meta(ge=1, le=MAX_HOT_PREFIXES)] | None = None  # default 64


class ListBlocks(RequestMessage, tag="list", kw_only=True):
    """A page of a tenant's stored blocks after the block hash `after` (see prefixd.store
    .listing)."""

    tenant: Text
    after: Annotated[bytes, Meta(min_length=16, max_length=16)] | None = None
    limit: Annotated[int, Meta(ge=1, le=MAX_HOT_PREFIXES)] | None = None  # default 1024


class Verify(RequestMessage, tag="verify", kw_only=True):
    fix: bool | None = None  # default false
    payloads: bool | None = None  # default true


AnyRequest: TypeAlias = (
    Hello
    | Attach
    | Put
    | Lookup
    | Load
    | Stats
    | Health
    | Purge
    | PutState
    | LookupState
    | LoadState
    | Hot
    | Verify
    | Route
    | Unpin
    | Delete
    | ListBlocks
)
REQUESTS: dict[str, type[RequestMessage]] = {  # by op
    str(kind.__struct_config__.tag): kind for kind in get_args(AnyRequest)
}
_OPS: dict[type[Struct], str] = {t: op for op, t in REQUESTS.items()}


def op_of(message: RequestMessage) -> str:
    """The operation a request names (its tag)."""
    return _OPS[type(message)]


# --- replies ------------------------------------------------------------------------------------


class Reply(Struct, kw_only=True):
    """A reply: the request's `id` and `ok` (a reply of the request's type when true, an
    ErrorReply when false)."""

    id: int | None
    ok: bool = True


class ErrorInfo(Struct, kw_only=True):
    code: str
    message: str


class ErrorReply(Reply, kw_only=True):
    """`{id, ok: false, error: {code, message}}`; `id` is nil for a frame whose id could not
    be read."""

    ok: bool = False
    error: ErrorInfo


class HelloReply(Reply, kw_only=True):
    protocol: int
    server: str
    ops: list[str]
    max_frame_bytes: int
    max_region_bytes: int
    max_inflight: int = 0
    models: dict[str, str] = msgspec.field(default_factory=dict)  # model -> weights fingerprint
    retired: int = 0
    instance: str = ""


class AttachReply(Reply, kw_only=True):
    region: int
    size: int


class PutReply(Reply, kw_only=True):
    stored: int
    existed: int


class LookupResult(Struct, kw_only=True):
    """`sizes`: the hit's payload sizes, u64 LE. `est_load_s` and `est_prefill_s`: the hit found,
    estimated; `withheld_tokens`: its tokens not offered, since loading them would not pay."""

    n_blocks: int
    n_tokens: int
    sizes: bytes
    est_load_s: float = 0.0
    est_prefill_s: float = 0.0
    withheld_tokens: int = 0


class LookupReply(Reply, kw_only=True):
    results: list[LookupResult]


class LoadReply(Reply, kw_only=True):
    """`offsets` (absolute in the region) and `sizes`: u64 LE. `next_size`: the payload size of
    the next stored block when the output span had no room for it (0: stopped for another
    reason), so a client that had less room than its region holds can ask again with more."""

    n_blocks: int
    n_tokens: int
    offsets: bytes
    sizes: bytes
    first_block: int = 0
    next_size: int = 0


class StatePart(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One state-group payload of a joint match: a page covering tokens [first_token,
    first_token + tokens), or the checkpoint at first_token (tokens 0). `offset`: where it was
    loaded (load_state replies only). `view`: its verified bytes there, set by the client that
    loaded it and never sent (left out at its default), so the reply's part is the result's."""

    group: str
    first_token: int
    tokens: int
    size: int
    offset: int | None = None
    view: memoryview | None = None


class JointResult(Struct, kw_only=True):
    """One prompt's answer to lookup_state."""

    reusable_tokens: int
    replay_from: int
    paged_tokens: int
    matched_tokens: int
    parts: list[StatePart]
    est_load_s: float = 0.0
    est_prefill_s: float = 0.0
    withheld_tokens: int = 0


class LookupStateReply(Reply, kw_only=True):
    results: list[JointResult]


class LoadStateReply(Reply, kw_only=True):
    reusable_tokens: int
    replay_from: int
    paged_tokens: int
    matched_tokens: int
    parts: list[StatePart]


class PutStateReply(PutReply, kw_only=True):
    parts: int


class HotEntry(Struct, kw_only=True):
    """A prefix to warm: `tokens` packed u32 LE, `sizes` u64 LE."""

    identity: WireIdentity
    tokens: bytes
    sizes: bytes
    score: float


class UnpinReply(Reply, kw_only=True):
    released: int  # pins released (blocks this connection had pinned)


class DeleteReply(Reply, kw_only=True):
    blocks: int  # blocks removed


class ListedEntry(Struct, kw_only=True, array_like=True):
    """One listed block: its identity's index in the reply's `identities`, its token ids or
    engine key (packed u32 LE), its payload size."""

    identity: int
    tokens: bytes
    size: int


class ListReply(Reply, kw_only=True):
    identities: list[WireIdentity]
    blocks: list[ListedEntry]
    next: bytes | None = None  # the cursor of the next page; absent: the listing is complete


class HotReply(Reply, kw_only=True):
    prefixes: list[HotEntry]


class RouteReply(Reply, kw_only=True):
    """Seconds: `score_s` = `prefill_saved_s` - `queue_s` - `load_s` (prefixd.daemon.routing)."""

    hit_blocks: int
    hit_tokens: int
    hit_bytes: int
    load_s: float
    prefill_saved_s: float
    loads_in_flight: int
    queue_bytes: int
    queue_s: float
    score_s: float


class PurgeReply(Reply, kw_only=True):
    identities: int
    blocks: int
    payload_bytes: int
    stored_bytes: int
    dry_run: bool
    seconds: float
    # the criteria ("tenant", "model") that name nothing the store holds (`prefixd purge` exits
    # 3); absent from an older daemon's reply
    unknown: Annotated[list[Name], Meta(max_length=2)] = msgspec.field(default_factory=list)


class VerifyReply(Reply, kw_only=True):
    """A check's report (`problems` listed as text, `count`, `by_kind`) and, with `fix`, what
    the repair did (`quarantined`, `fixed`, `remaining`): see prefixd.store.check_report. The
    daemon sends the report's map as it is; without `fix` those three are absent."""

    blocks: int
    parts: int
    problems: list[str]
    count: int = 0
    by_kind: dict[str, int] | None = None
    quarantined: int | None = None
    fixed: int | None = None
    remaining: list[str] | None = None


class StatsReply(Reply, kw_only=True):
    """Reports of other modules, passed through: the store's totals, the server's counters and
    the metrics summary (`prefixd stats`)."""

    store: dict[str, Any]
    server: dict[str, Any]
    metrics: dict[str, Any]


class HealthReply(Reply, kw_only=True):
    """The daemon answers; `data_dir` is the store it serves (so a command told only the socket
    works on the same store)."""

    status: str
    uptime_s: float
    connections: int
    data_dir: str | None = None


REPLY_OF: dict[type[RequestMessage], type[Reply]] = {
    Hello: HelloReply,
    Attach: AttachReply,
    Put: PutReply,
    Lookup: LookupReply,
    Load: LoadReply,
    Stats: StatsReply,
    Health: HealthReply,
    Purge: PurgeReply,
    PutState: PutStateReply,
    LookupState: LookupStateReply,
    LoadState: LoadStateReply,
    Hot: HotReply,
    Verify: VerifyReply,
    Route: RouteReply,
    Unpin: UnpinReply,
    Delete: DeleteReply,
    ListBlocks: ListReply,
}


REPLIES: tuple[type[Reply], ...] = (ErrorReply, *REPLY_OF.values())


def error_reply(rid: int | None, code: ErrorCode, message: str) -> ErrorReply:
    return ErrorReply(id=rid, error=ErrorInfo(code=code.value, message=message))
