"""The typed wire: every request round-trips, plain msgpack maps with today's field names decode
(old clients keep working), unknown fields are ignored, oversized, too deep and mistyped input is
refused with the right code, and nothing but the protocol's errors ever comes out."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd import Identity
from prefixd.errors import (
    BadFrameError,
    IdentityError,
    OpenTailError,
    PrefixdError,
    ProtocolError,
    RemoteError,
    RequestError,
    TokenError,
)
from prefixd.schema.state import MAX_GROUPS, StateGroup
from prefixd.wire.decoding import (
    decode_reply,
    decode_request,
    encode,
    reply_id,
)
from prefixd.wire.errors import ErrorCode
from prefixd.wire.frames import HEADER, encode_frame
from prefixd.wire.messages import (
    MAX_BLOCKS_PER_PUT,
    MAX_HOT_PREFIXES,
    MAX_PROMPTS_PER_LOOKUP,
    MAX_SERVES,
    MAX_TEXT,
    REPLIES,
    REQUESTS,
    Attach,
    AttachReply,
    Delete,
    DeleteReply,
    ErrorReply,
    Health,
    HealthReply,
    Hello,
    HelloReply,
    Hot,
    HotEntry,
    HotReply,
    JointResult,
    ListBlocks,
    ListedEntry,
    ListReply,
    Load,
    LoadReply,
    LoadState,
    LoadStateReply,
    Lookup,
    LookupReply,
    LookupResult,
    LookupState,
    LookupStateReply,
    Prompt,
    Purge,
    PurgeReply,
    Put,
    PutReply,
    PutState,
    PutStateReply,
    RequestMessage,
    Route,
    RouteReply,
    Served,
    StatePart,
    Stats,
    StatsReply,
    Unpin,
    UnpinReply,
    Verify,
    VerifyReply,
    WireIdentity,
    error_reply,
    op_of,
)
from tests.daemon.conftest import make_identity

IDENTITY = make_identity()
HYBRID = make_identity(state=(StateGroup.paged("mla", page_blocks=2), StateGroup.checkpoint("kda")))
IDENTITY_DICT = IDENTITY.to_dict()
HYBRID_DICT = HYBRID.to_dict()
# What the daemon writes of an identity: unset optional fields left out.
HYBRID_WIRE = {k: v for k, v in HYBRID_DICT.items() if v is not None}
TOKENS = np.arange(12, dtype="<u4").tobytes()
SECRET = 987654321  # a token id that must never appear in an error message
SECRET_TOKENS = np.full(8, SECRET, dtype="<u4").tobytes()


def body(message: Any) -> bytes:
    """A body as a plain msgpack client writes it (the reference encoder, not msgspec)."""
    return bytes(msgpack.packb(message, use_bin_type=True))


def refused(message: Any) -> RequestError:
    raw = message if isinstance(message, bytes) else body(message)
    with pytest.raises(RequestError) as caught:
        decode_request(raw)
    return caught.value


def expect(message: Any, code: ErrorCode, *names: str) -> RequestError:
    error = refused(message)
    assert error.code == code, (error.code, error.message)
    for name in names:
        assert name in error.message, (name, error.message)
    return error


# --- every request, both ways -------------------------------------------------------------------

WIRE = WireIdentity.of(IDENTITY)
WIRE_HYBRID = WireIdentity.of(HYBRID)
REQUEST_EXAMPLES: list[RequestMessage] = [
    Hello(id=1, protocol=1),
    Hello(id=2, protocol=1, client="engine-7", serves=[Served(model="m", weights="w2")]),
    Attach(id=3, size=4096),
    Put(id=4, identity=WIRE, tokens=TOKENS, n_tokens=3, blocks=[(1, 0, 8), (1, 8, 8)]),
    Put(id=5, identity=WIRE, tokens_span=(2, 64, 3), first_block=1, blocks=[]),
    Lookup(id=6, identity=WIRE, prompts=[Prompt(tokens=TOKENS, hashes=b"\x01" * 16)]),
    Lookup(id=7, identity=WIRE, prompts=[Prompt(tokens_span=(2, 0, 3), n_tokens=3), Prompt()]),
    Load(id=8, identity=WIRE, tokens=TOKENS, region=1),
    Load(
        id=9,
        identity=WIRE,
        tokens=TOKENS,
        hashes=b"\x02" * 16,
        region=1,
        offset=64,
        length=128,
        max_blocks=2,
        first_block=1,
        warm=True,
    ),
    Stats(id=10),
    Health(id=11),
    Purge(id=12, tenant="a"),
    Purge(id=13, model="m", keep={"weights": "w", "adapter": None}, older_than_s=5.5, dry_run=True),
    Purge(id=14, everything=True),
    PutState(
        id=15,
        identity=WIRE_HYBRID,
        tokens=TOKENS,
        upto_tokens=8,
        paged={"mla": [(1, 0, 16)]},
        checkpoints={"kda": [(8, (1, 16, 4))]},
    ),
    LookupState(id=16, identity=WIRE_HYBRID, prompts=[Prompt(tokens=TOKENS)]),
    LoadState(id=17, identity=WIRE_HYBRID, tokens=TOKENS, region=1, offset=0, length=64),
    Hot(id=18, budget_bytes=1 << 20, tenant="a"),
    Hot(id=19, budget_bytes=0, tenant="b", limit=MAX_HOT_PREFIXES),
    Verify(id=20),
    Verify(id=21, fix=True, payloads=False),
    Route(id=22, identity=WIRE, tokens=TOKENS),
    Route(id=23, identity=WIRE, tokens_span=(1, 0, 8), n_tokens=8, hashes=b"\x01" * 16),
    Lookup(id=(1 << 63) - 1, identity=WIRE, prompts=[]),
    Lookup(id=22, identity=WIRE, prompts=[Prompt(tokens=TOKENS)], pin=True),
    Lookup(
        id=23,
        identity=WIRE,
        prompts=[Prompt(tokens=TOKENS)],
        prefill_tokens_per_s=25_000.0,
        stored_only=True,
    ),
    LookupState(
        id=24, identity=WIRE_HYBRID, prompts=[Prompt(tokens=TOKENS)], prefill_tokens_per_s=1e4
    ),
    Unpin(id=23, identity=WIRE, prompts=[Prompt(tokens=TOKENS)]),
    Delete(id=24, identity=WIRE, prompts=[Prompt(tokens_span=(2, 0, 3), n_tokens=3)]),
    ListBlocks(id=25, tenant="a"),
    ListBlocks(id=26, tenant="a", after=b"\x03" * 16, limit=7),
]


def test_every_operation_has_a_request_struct() -> None:
    assert set(REQUESTS) == {
        "hello",
        "attach",
        "put",
        "lookup",
        "load",
        "stats",
        "health",
        "purge",
        "put_state",
        "lookup_state",
        "load_state",
        "hot",
        "verify",
        "route",
        "unpin",
        "delete",
        "list",
    }
    assert {op_of(m) for m in REQUEST_EXAMPLES} == set(REQUESTS)


@pytest.mark.parametrize("message", REQUEST_EXAMPLES, ids=lambda m: f"{op_of(m)}-{m.id}")
def test_every_request_round_trips(message: RequestMessage) -> None:
    frame = encode(message)
    (length,) = HEADER.unpack(frame[: HEADER.size])
    assert length == len(frame) - HEADER.size
    raw = frame[HEADER.size :]
    assert decode_request(raw) == message
    assert decode_request(bytearray(raw)) == message  # as the daemon reads it
    assert decode_request(memoryview(raw)) == message
    plain = msgpack.unpackb(raw, raw=False)
    assert plain["op"] == op_of(message) and plain["id"] == message.id
    assert decode_request(body(plain)) == message  # re-encoded by plain msgpack


def test_identities_survive_the_wire() -> None:
    for identity in (IDENTITY, HYBRID, Identity(**{**IDENTITY_DICT, "adapter": "lora", "mm": "v"})):
        wire = WireIdentity.of(identity)
        assert wire.to_identity() == identity
        assert wire.to_identity().digest == identity.digest
        # the bytes decode into today's map: Identity.to_dict(), state groups as maps, unset
        # optional fields left out (a daemon that predates one still reads the rest)
        plain = {k: v for k, v in identity.to_dict().items() if v is not None}
        assert msgpack.unpackb(msgspec.msgpack.encode(wire), raw=False) == plain
        assert msgspec.msgpack.decode(body(identity.to_dict()), type=WireIdentity) == wire
    assert hash(WIRE) == hash(WireIdentity.of(IDENTITY))  # the daemon's cache key


# --- what old clients send ----------------------------------------------------------------------

OLD_CLIENT_FRAMES: list[tuple[dict[str, Any], RequestMessage]] = [
    (
        {"op": "hello", "protocol": 1, "client": "prefixd-client", "id": 1},
        Hello(id=1, protocol=1, client="prefixd-client"),
    ),
    (
        {"op": "hello", "protocol": 1, "serves": [{"model": "m", "weights": "w"}], "id": 2},
        Hello(id=2, protocol=1, serves=[Served(model="m", weights="w")]),
    ),
    ({"op": "attach", "size": 65536, "id": 3}, Attach(id=3, size=65536)),
    (
        {
            "op": "put",
            "identity": IDENTITY_DICT,
            "tokens": TOKENS,
            "n_tokens": 3,
            "first_block": 0,
            "blocks": [[1, 0, 256], [1, 256, 256]],
            "id": 4,
        },
        Put(
            id=4,
            identity=WIRE,
            tokens=TOKENS,
            n_tokens=3,
            first_block=0,
            blocks=[(1, 0, 256), (1, 256, 256)],
        ),
    ),
    (
        {
            "op": "lookup",
            "identity": IDENTITY_DICT,
            "prompts": [{"tokens_span": [2, 0, 3], "n_tokens": 3}, {"tokens": TOKENS}],
            "id": 5,
        },
        Lookup(
            id=5,
            identity=WIRE,
            prompts=[Prompt(tokens_span=(2, 0, 3), n_tokens=3), Prompt(tokens=TOKENS)],
        ),
    ),
    (
        {
            "op": "load",
            "identity": IDENTITY_DICT,
            "tokens": TOKENS,
            "n_tokens": 3,
            "region": 1,
            "offset": 0,
            "length": 4096,
            "max_blocks": None,  # nil is absent, as it always was
            "hashes": None,
            "id": 6,
        },
        Load(id=6, identity=WIRE, tokens=TOKENS, n_tokens=3, region=1, offset=0, length=4096),
    ),
    (
        {
            "op": "purge",
            "dry_run": False,
            "tenant": "a",
            "model": None,
            "older_than_s": 60,
            "id": 7,
        },
        Purge(id=7, dry_run=False, tenant="a", older_than_s=60.0),
    ),
    (
        {
            "op": "put_state",
            "identity": HYBRID_DICT,
            "tokens": TOKENS,
            "n_tokens": 3,
            "first_block": 0,
            "paged": {"mla": [[1, 0, 16]]},
            "checkpoints": {"kda": [[8, [1, 16, 4]]]},
            "upto_tokens": 8,
            "id": 8,
        },
        PutState(
            id=8,
            identity=WIRE_HYBRID,
            tokens=TOKENS,
            n_tokens=3,
            first_block=0,
            paged={"mla": [(1, 0, 16)]},
            checkpoints={"kda": [(8, (1, 16, 4))]},
            upto_tokens=8,
        ),
    ),
    (
        {"op": "hot", "budget_bytes": 100, "tenant": "a", "limit": 64, "id": 9},
        Hot(id=9, budget_bytes=100, tenant="a", limit=64),
    ),
    ({"op": "verify", "fix": True, "id": 10}, Verify(id=10, fix=True)),
    ({"id": 11, "op": "stats"}, Stats(id=11)),
    ({"op": "health", "id": 12}, Health(id=12)),
]


@pytest.mark.parametrize(("plain", "typed"), OLD_CLIENT_FRAMES, ids=lambda v: str(v)[:24])
def test_plain_msgpack_maps_of_old_clients_decode(
    plain: dict[str, Any], typed: RequestMessage
) -> None:
    assert decode_request(body(plain)) == typed
    assert decode_request(encode_frame(plain)[HEADER.size :]) == typed


def test_unknown_fields_are_ignored_except_in_an_identity() -> None:
    deep: Any = 1
    for _ in range(20):
        deep = {"x": [deep]}  # within the recursion limit: skipped, not refused
    message = {
        "id": 1,
        "op": "lookup",
        "identity": IDENTITY_DICT,
        "prompts": [{"tokens": TOKENS, "future": [1, {"a": b"x"}]}],
        "zzz_unknown": deep,
        "priority": 3.5,
    }
    assert decode_request(body(message)) == Lookup(
        id=1, identity=WIRE, prompts=[Prompt(tokens=TOKENS)]
    )
    hello = {
        "id": 2,
        "op": "hello",
        "protocol": 1,
        "serves": [{"model": "m", "weights": "w", "x": 1}],
    }
    assert decode_request(body(hello)) == Hello(
        id=2, protocol=1, serves=[Served(model="m", weights="w")]
    )
    expect(
        {**message, "identity": {**IDENTITY_DICT, "colour": "blue"}},
        ErrorCode.BAD_IDENTITY,
        "identity.colour",
    )
    state = [{**HYBRID_DICT["state"][0], "extra": 1}]
    expect(
        {**message, "identity": {**HYBRID_DICT, "state": state}},
        ErrorCode.BAD_IDENTITY,
        "identity.state[0].extra",
    )


@pytest.mark.parametrize("rate", [0.0, -1.0, 1e13, float("inf"), float("nan"), "fast", True])
def test_a_reported_prefill_throughput_out_of_bounds_is_refused(rate: Any) -> None:
    """A peer cannot make the benefit rule divide by zero, nor hand it a throughput no engine
    has (the field's bounds), nor anything that is not a float."""
    lookup = {"id": 1, "op": "lookup", "identity": IDENTITY_DICT, "prompts": []}
    assert decode_request(body({**lookup, "prefill_tokens_per_s": 2.5e4}))
    expect({**lookup, "prefill_tokens_per_s": rate}, ErrorCode.BAD_REQUEST, "prefill_tokens_per_s")


# --- limits -------------------------------------------------------------------------------------


def test_oversized_arrays_maps_and_strings_are_refused() -> None:
    put = {"id": 1, "op": "put", "identity": IDENTITY_DICT, "tokens": TOKENS}
    assert decode_request(body({**put, "blocks": [[1, 0, 1]] * MAX_BLOCKS_PER_PUT}))
    expect(
        {**put, "blocks": [[1, 0, 1]] * (MAX_BLOCKS_PER_PUT + 1)}, ErrorCode.BAD_REQUEST, "blocks"
    )
    lookup = {"id": 2, "op": "lookup", "identity": IDENTITY_DICT}
    assert decode_request(body({**lookup, "prompts": [{}] * MAX_PROMPTS_PER_LOOKUP}))
    expect(
        {**lookup, "prompts": [{}] * (MAX_PROMPTS_PER_LOOKUP + 1)}, ErrorCode.BAD_REQUEST, "prompts"
    )
    serves = [{"model": "m", "weights": "w"}] * (MAX_SERVES + 1)
    expect(
        {"id": 3, "op": "hello", "protocol": 1, "serves": serves}, ErrorCode.BAD_REQUEST, "serves"
    )
    state = {"id": 4, "op": "put_state", "identity": HYBRID_DICT, "tokens": TOKENS}
    groups: dict[str, list[Any]] = {f"g{i}": [] for i in range(MAX_GROUPS + 1)}
    expect({**state, "paged": groups}, ErrorCode.BAD_REQUEST, "paged")
    expect({**state, "checkpoints": groups}, ErrorCode.BAD_REQUEST, "checkpoints")
    expect({**state, "paged": {"x" * 65: []}}, ErrorCode.BAD_REQUEST, "paged", "key")
    groups_spec = [{"name": f"g{i}", "kind": "checkpoint"} for i in range(MAX_GROUPS + 1)]
    expect(
        {**lookup, "prompts": [], "identity": {**IDENTITY_DICT, "state": groups_spec}},
        ErrorCode.BAD_IDENTITY,
        "identity.state",
    )
    expect(
        {**lookup, "prompts": [], "identity": {**IDENTITY_DICT, "model": "x" * (MAX_TEXT + 1)}},
        ErrorCode.BAD_IDENTITY,
        "identity.model",
    )
    long = "y" * (MAX_TEXT + 1)
    expect({"id": 5, "op": "hello", "protocol": 1, "client": long}, ErrorCode.BAD_REQUEST, "client")
    expect(
        {"id": 6, "op": "hot", "budget_bytes": 1, "tenant": long}, ErrorCode.BAD_IDENTITY, "tenant"
    )
    expect(
        {"id": 7, "op": "purge", "keep": {f"k{i}": "v" for i in range(17)}}, ErrorCode.BAD_REQUEST
    )
    expect(
        {"id": 8, "op": "hot", "budget_bytes": 1, "tenant": "a", "limit": MAX_HOT_PREFIXES + 1},
        ErrorCode.BAD_REQUEST,
        "limit",
    )


@pytest.mark.parametrize(
    ("paged", "checkpoints", "fits"),
    [
        (MAX_BLOCKS_PER_PUT, 0, True),
        (MAX_BLOCKS_PER_PUT - 1, 1, True),
        (MAX_BLOCKS_PER_PUT, 1, False),
        (7, MAX_BLOCKS_PER_PUT - 6, False),
        (40_000, 30_000, False),
    ],
)
def test_a_put_state_is_bounded_in_all_before_its_entries_are_built(
    paged: int, checkpoints: int, fits: bool
) -> None:
    """Each group may hold MAX_BLOCKS_PER_PUT entries, all groups together no more: counted from
    the arrays' headers (fixarray, array 16, array 32) before any entry is built."""
    request = {
        "id": 9,
        "op": "put_state",
        "identity": HYBRID_DICT,
        "tokens": TOKENS,
        "paged": {"a": [[1, 0, 1]] * paged, "z": []},
        "checkpoints": {"b": [[16, [1, 0, 1]]] * checkpoints},
    }
    if fits:
        assert decode_request(body(request))
    else:
        error = expect(request, ErrorCode.BAD_REQUEST, "at most 65536 payloads", "all groups")
        assert (error.rid, error.op) == (9, "put_state")


def test_a_put_state_with_a_million_entries_is_refused_without_building_them() -> None:
    state = {"id": 9, "op": "put_state", "identity": HYBRID_DICT, "tokens": TOKENS}
    huge = body({**state, "checkpoints": {f"g{i}": [[0, [0, 0, 0]]] * 65536 for i in range(16)}})
    tracemalloc.start()
    try:
        expect(huge, ErrorCode.BAD_REQUEST, "all groups together")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing it allocated {peak} bytes"


def test_too_deep_nesting_is_refused() -> None:
    deep = b"\x91" * 5000 + b"\xc0"
    error = expect(deep, ErrorCode.BAD_FRAME)  # an array, not a map
    assert error.rid is None
    # deep in an ignored field: msgspec's recursion limit, before the id is of any use
    prefix = b"\x83\xa2id\x01\xa2op\xa6health\xa3zzz"
    error = expect(prefix + deep, ErrorCode.BAD_FRAME, "deep")
    assert error.rid is None
    # deeper than the schema where a typed field is: a wrong type, named
    nested: Any = [[[[[[["mla"]]]]]]]
    expect(
        {"id": 2, "op": "lookup", "identity": {**IDENTITY_DICT, "state": nested}, "prompts": []},
        ErrorCode.BAD_IDENTITY,
        "identity.state[0]",
    )
    expect(
        {"id": 3, "op": "put", "identity": IDENTITY_DICT, "tokens": b"", "blocks": [[[1], 0, 8]]},
        ErrorCode.BAD_REQUEST,
        "blocks[0][0]",
    )


# --- codes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",
        b"",
        b"\x92\x01",
        b"\xdb\xff\xff\xff\xff",
        body({"id": 1, "op": "health"}) + b"\x00",
        body({1: 2}),
        body([1, 2]),
        body(5),
        body(None),
        body({"op": "health"}),
        body({"id": "1", "op": "health"}),
        body({"id": -1, "op": "health"}),
        body({"id": True, "op": "health"}),
        body({"id": 1.0, "op": "health"}),
        body({"id": 2**64 - 1, "op": "health"}),
        body({"id": 2**63, "op": "health"}),
        body({"id": None, "op": "health"}),
    ],
)
def test_no_request_is_bad_frame_without_an_id(raw: bytes) -> None:
    error = expect(raw, ErrorCode.BAD_FRAME)
    assert error.rid is None and error.op is None


@pytest.mark.parametrize("op", [None, 5, b"health", ["health"], {"x": 1}, True])
def test_no_str_op_is_bad_frame_with_the_id(op: Any) -> None:
    message: dict[str, Any] = {"id": 77} if op is None else {"id": 77, "op": op}
    error = expect(message, ErrorCode.BAD_FRAME, "op")
    assert error.rid == 77 and error.op is None


def test_unknown_ops() -> None:
    for op in ("frobnicate", "Health", "", "x" * 10_000):
        error = expect({"id": 5, "op": op}, ErrorCode.UNKNOWN_OP)
        assert error.rid == 5 and len(error.message) < 200


def _put(**change: Any) -> dict[str, Any]:
    message = {"id": 9, "op": "put", "identity": IDENTITY_DICT, "tokens": TOKENS, "blocks": []}
    return {k: v for k, v in {**message, **change}.items() if v is not None}


def _lookup(prompt: Any) -> dict[str, Any]:
    return {"id": 9, "op": "lookup", "identity": IDENTITY_DICT, "prompts": [prompt]}


def _load(**change: Any) -> dict[str, Any]:
    message = {"id": 9, "op": "load", "identity": IDENTITY_DICT, "tokens": TOKENS, "region": 1}
    return {**message, **change}


WRONG = [
    (_put(identity="m"), ErrorCode.BAD_IDENTITY, "identity"),
    (_put(identity=["m"]), ErrorCode.BAD_IDENTITY, "identity"),
    ({k: v for k, v in _put().items() if k != "identity"}, ErrorCode.BAD_IDENTITY, "identity"),
    (_put(identity={**IDENTITY_DICT, "block_tokens": 4.0}), ErrorCode.BAD_IDENTITY, "block_tokens"),
    (
        _put(identity={**IDENTITY_DICT, "block_tokens": True}),
        ErrorCode.BAD_IDENTITY,
        "block_tokens",
    ),
    (
        _put(identity={**IDENTITY_DICT, "block_tokens": 1 << 40}),
        ErrorCode.BAD_IDENTITY,
        "block_tokens",
    ),
    (_put(identity={**IDENTITY_DICT, "key_bytes": 12}), ErrorCode.BAD_IDENTITY, "key_bytes"),
    (_put(identity={**IDENTITY_DICT, "key_bytes": 34}), ErrorCode.BAD_IDENTITY, "key_bytes"),
    (_put(identity={**IDENTITY_DICT, "key_bytes": "36"}), ErrorCode.BAD_IDENTITY, "key_bytes"),
    (_put(identity={**IDENTITY_DICT, "model": ""}), ErrorCode.BAD_IDENTITY, "model"),
    (_put(identity={**IDENTITY_DICT, "mm": 3}), ErrorCode.BAD_IDENTITY, "mm"),
    (
        _put(identity={k: v for k, v in IDENTITY_DICT.items() if k != "weights"}),
        ErrorCode.BAD_IDENTITY,
        "weights",
    ),
    (_put(tokens="1 2 3 4"), ErrorCode.BAD_TOKENS, "tokens"),
    (_put(tokens=[1, 2, 3, 4]), ErrorCode.BAD_TOKENS, "tokens"),
    (_put(n_tokens="3"), ErrorCode.BAD_TOKENS, "n_tokens"),
    (_put(first_block="0"), ErrorCode.BAD_REQUEST, "first_block"),
    (_put(first_block=-1), ErrorCode.BAD_REQUEST, "first_block"),
    (_put(first_block=1.0), ErrorCode.BAD_REQUEST, "first_block"),
    (_put(blocks={"0": [1, 0, 8]}), ErrorCode.BAD_REQUEST, "blocks"),
    (_put(blocks=b"\x01\x00\x08"), ErrorCode.BAD_REQUEST, "blocks"),
    ({k: v for k, v in _put().items() if k != "blocks"}, ErrorCode.BAD_REQUEST, "blocks"),
    (_put(blocks=[[1, -5, 8]]), ErrorCode.BAD_REQUEST, "blocks[0]"),
    (_put(blocks=[[1, 0, 8], [1, 8, -8]]), ErrorCode.BAD_REQUEST, "blocks[1]"),
    (_put(blocks=[[1, 0]]), ErrorCode.BAD_REQUEST, "blocks[0]"),
    (_put(blocks=[[True, 0, 8]]), ErrorCode.BAD_REQUEST, "blocks[0]"),
    (_put(blocks=[[1, 0, 1 << 62]]), ErrorCode.BAD_REQUEST, "blocks[0]"),
    (_put(tokens_span=[1, 0]), ErrorCode.BAD_REQUEST, "tokens_span"),
    (_lookup(5), ErrorCode.BAD_REQUEST, "prompts[0]"),
    (_lookup({"tokens": 5}), ErrorCode.BAD_TOKENS, "prompts[0].tokens"),
    (_lookup({"hashes": "ab"}), ErrorCode.BAD_TOKENS, "prompts[0].hashes"),
    (_lookup({"n_tokens": "2"}), ErrorCode.BAD_TOKENS, "prompts[0].n_tokens"),
    (_lookup({"tokens_span": [1, -1, 2]}), ErrorCode.BAD_REQUEST, "prompts[0].tokens_span"),
    (_lookup({"tokens_span": "1,0,2"}), ErrorCode.BAD_REQUEST, "prompts[0].tokens_span"),
    (
        {"id": 9, "op": "lookup", "identity": IDENTITY_DICT, "prompts": "x"},
        ErrorCode.BAD_REQUEST,
        "prompts",
    ),
    ({"id": 9, "op": "lookup", "identity": IDENTITY_DICT}, ErrorCode.BAD_REQUEST, "prompts"),
    (_load(region="1"), ErrorCode.BAD_REQUEST, "region"),
    (_load(region=-1), ErrorCode.BAD_REQUEST, "region"),
    (_load(offset=-1), ErrorCode.BAD_REQUEST, "offset"),
    (_load(length="all"), ErrorCode.BAD_REQUEST, "length"),
    (_load(max_blocks="3"), ErrorCode.BAD_REQUEST, "max_blocks"),
    (_load(hashes=5), ErrorCode.BAD_TOKENS, "hashes"),
    (_load(warm="yes"), ErrorCode.BAD_REQUEST, "warm"),
    ({"id": 9, "op": "hello"}, ErrorCode.BAD_REQUEST, "protocol"),
    ({"id": 9, "op": "hello", "protocol": "1"}, ErrorCode.BAD_REQUEST, "protocol"),
    (
        {"id": 9, "op": "hello", "protocol": 1, "serves": [{"model": "m", "weights": ""}]},
        ErrorCode.BAD_REQUEST,
        "serves[0].weights",
    ),
    ({"id": 9, "op": "hello", "protocol": 1, "serves": [5]}, ErrorCode.BAD_REQUEST, "serves[0]"),
    ({"id": 9, "op": "attach", "size": "4096"}, ErrorCode.BAD_REQUEST, "size"),
    ({"id": 9, "op": "attach", "size": 0}, ErrorCode.BAD_REQUEST, "size"),
    ({"id": 9, "op": "attach"}, ErrorCode.BAD_REQUEST, "size"),
    ({"id": 9, "op": "hot", "budget_bytes": 1}, ErrorCode.BAD_IDENTITY, "tenant"),
    ({"id": 9, "op": "hot", "budget_bytes": "1", "tenant": "a"}, ErrorCode.BAD_REQUEST, "budget"),
    (
        {"id": 9, "op": "hot", "budget_bytes": 1, "tenant": "a", "limit": 0},
        ErrorCode.BAD_REQUEST,
        "limit",
    ),
    ({"id": 9, "op": "purge", "keep": ["weights"]}, ErrorCode.BAD_REQUEST, "keep"),
    ({"id": 9, "op": "purge", "older_than_s": "1"}, ErrorCode.BAD_REQUEST, "older_than_s"),
    ({"id": 9, "op": "purge", "everything": 1}, ErrorCode.BAD_REQUEST, "everything"),
    ({"id": 9, "op": "verify", "fix": "yes"}, ErrorCode.BAD_REQUEST, "fix"),
    (
        {"id": 9, "op": "put_state", "identity": HYBRID_DICT, "tokens": TOKENS, "paged": {1: []}},
        ErrorCode.BAD_REQUEST,
        "paged",
    ),
    (
        {
            "id": 9,
            "op": "put_state",
            "identity": HYBRID_DICT,
            "tokens": TOKENS,
            "checkpoints": {"kda": [[-1, [1, 0, 4]]]},
        },
        ErrorCode.BAD_REQUEST,
        "checkpoints",
    ),
    (
        {
            "id": 9,
            "op": "put_state",
            "identity": HYBRID_DICT,
            "tokens": TOKENS,
            "checkpoints": {"kda": [[8, [1, 0]]]},
        },
        ErrorCode.BAD_REQUEST,
        "checkpoints",
    ),
    (
        {
            "id": 9,
            "op": "lookup_state",
            "identity": {**HYBRID_DICT, "state": [{"name": "x"}]},
            "prompts": [],
        },
        ErrorCode.BAD_IDENTITY,
        "identity.state[0].kind",
    ),
    (
        {"id": 9, "op": "lookup_state", "identity": {**HYBRID_DICT, "state": []}, "prompts": []},
        ErrorCode.BAD_IDENTITY,
        "identity.state",
    ),
]


@pytest.mark.parametrize(("message", "code", "name"), WRONG, ids=lambda v: str(v)[:40])
def test_wrong_fields_get_their_code_and_name(
    message: dict[str, Any], code: ErrorCode, name: str
) -> None:
    error = expect(message, code, name)
    assert error.rid == 9 and error.op == message["op"]
    assert error.message.startswith(f"{message['op']}: ")


def test_messages_never_echo_values() -> None:
    secret_text = str(SECRET)
    cases: list[Any] = [
        _put(tokens=secret_text),
        _put(blocks=[[1, SECRET, -SECRET]]),
        _lookup({"tokens": [SECRET]}),
        _lookup({"hashes": secret_text}),
        _lookup({"n_tokens": secret_text}),
        _load(region=SECRET * 10**10),
        _put(identity={**IDENTITY_DICT, "model": secret_text * 1000}),
        _put(identity={**IDENTITY_DICT, "block_tokens": SECRET}),
        {"id": 9, "op": "hello", "protocol": secret_text},
        {"id": secret_text, "op": "health"},
        SECRET_TOKENS,  # raw token bytes as a body
        body({"id": 1, "op": "health"}) + SECRET_TOKENS,
        body({"id": 1, "op": "hot", "budget_bytes": 1, "tenant": SECRET_TOKENS}),
    ]
    for case in cases:
        error = refused(case)
        assert secret_text not in error.message, error.message
        assert SECRET_TOKENS[:4].hex() not in error.message
        assert "\x00" not in error.message and len(error.message) < 300


# --- nothing but protocol errors ----------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
FIELD_NAMES = sorted(
    {name for kind in REQUESTS.values() for name in kind.__struct_fields__}
    | {"model", "weights", "tenant", "state", "hashes"}
)
plausible = st.one_of(
    anything,
    st.sampled_from([IDENTITY_DICT, HYBRID_DICT, TOKENS, [1, 0, 8], [[1, 0, 8]], {"mla": []}]),
    st.lists(st.fixed_dictionaries({}, optional={"tokens": anything, "n_tokens": anything})),
)
requests = st.fixed_dictionaries(
    {"id": st.one_of(st.integers(0, 2**63 - 1), anything), "op": st.sampled_from(sorted(REQUESTS))},
    optional={"x": anything},
).flatmap(
    lambda base: st.dictionaries(st.sampled_from(FIELD_NAMES), plausible, max_size=6).map(
        lambda fields: {**fields, **base}
    )
)
SETTINGS = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(raw: bytes) -> None:
    try:
        message = decode_request(raw)
    except RequestError as error:
        assert isinstance(error, ProtocolError)
        assert error.code in set(ErrorCode) - {ErrorCode.INTERNAL}, error
        assert error.message
        if error.rid is None:
            assert error.code == ErrorCode.BAD_FRAME
        return
    assert isinstance(message, RequestMessage)
    assert op_of(message) in REQUESTS
    assert decode_request(encode(message)[HEADER.size :]) == message


@SETTINGS
@given(value=anything)
def test_random_msgpack_values_raise_only_protocol_errors(value: Any) -> None:
    try:
        raw = body(value)
    except (OverflowError, ValueError, TypeError):
        return
    _check(raw)


@SETTINGS
@given(message=requests)
def test_random_requests_raise_only_protocol_errors(message: dict[str, Any]) -> None:
    try:
        raw = body(message)
    except (OverflowError, ValueError, TypeError):
        return
    _check(raw)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_errors(raw: bytes) -> None:
    _check(raw)


# --- replies ------------------------------------------------------------------------------------

SIZES = np.array([256, 256], dtype="<u8").tobytes()
REPLY_EXAMPLES: list[tuple[Any, dict[str, Any]]] = [
    (
        HelloReply(
            id=1,
            protocol=1,
            server="prefixd/0.1.0",
            ops=sorted(REQUESTS),
            max_frame_bytes=1 << 24,
            max_region_bytes=1 << 30,
            max_inflight=64,
            models={"m": "w"},
            retired=0,
            instance="00ff",
        ),
        {
            "id": 1,
            "ok": True,
            "protocol": 1,
            "server": "prefixd/0.1.0",
            "ops": sorted(REQUESTS),
            "max_frame_bytes": 1 << 24,
            "max_region_bytes": 1 << 30,
            "max_inflight": 64,
            "models": {"m": "w"},
            "retired": 0,
            "instance": "00ff",
        },
    ),
    (AttachReply(id=2, region=1, size=4096), {"id": 2, "ok": True, "region": 1, "size": 4096}),
    (PutReply(id=3, stored=2, existed=1), {"id": 3, "ok": True, "stored": 2, "existed": 1}),
    (
        LookupReply(
            id=4,
            results=[
                LookupResult(
                    n_blocks=2, n_tokens=8, sizes=SIZES, est_load_s=1e-3, est_prefill_s=0.5
                ),
                LookupResult(
                    n_blocks=0,
                    n_tokens=0,
                    sizes=b"",
                    est_load_s=0.5,
                    est_prefill_s=1e-3,
                    withheld_tokens=8,
                ),
            ],
        ),
        {
            "id": 4,
            "ok": True,
            "results": [
                {
                    "n_blocks": 2,
                    "n_tokens": 8,
                    "sizes": SIZES,
                    "est_load_s": 1e-3,
                    "est_prefill_s": 0.5,
                    "withheld_tokens": 0,
                },
                {
                    "n_blocks": 0,
                    "n_tokens": 0,
                    "sizes": b"",
                    "est_load_s": 0.5,
                    "est_prefill_s": 1e-3,
                    "withheld_tokens": 8,  # found, and not worth loading
                },
            ],
        },
    ),
    (
        LoadReply(id=5, n_blocks=2, n_tokens=8, offsets=SIZES, sizes=SIZES, first_block=0),
        {
            "id": 5,
            "ok": True,
            "n_blocks": 2,
            "n_tokens": 8,
            "offsets": SIZES,
            "sizes": SIZES,
            "first_block": 0,
            "next_size": 0,
        },
    ),
    (
        LookupStateReply(
            id=6,
            results=[
                JointResult(
                    reusable_tokens=8,
                    replay_from=8,
                    paged_tokens=8,
                    matched_tokens=12,
                    parts=[StatePart(group="mla", first_token=0, tokens=8, size=64)],
                    est_load_s=0.25,
                    est_prefill_s=1.0,
                )
            ],
        ),
        {
            "id": 6,
            "ok": True,
            "results": [
                {
                    "reusable_tokens": 8,
                    "replay_from": 8,
                    "paged_tokens": 8,
                    "matched_tokens": 12,
                    "parts": [{"group": "mla", "first_token": 0, "tokens": 8, "size": 64}],
                    "est_load_s": 0.25,
                    "est_prefill_s": 1.0,
                    "withheld_tokens": 0,
                }
            ],
        },
    ),
    (
        LoadStateReply(
            id=7,
            reusable_tokens=8,
            replay_from=8,
            paged_tokens=8,
            matched_tokens=8,
            parts=[StatePart(group="mla", first_token=0, tokens=8, size=64, offset=128)],
        ),
        {
            "id": 7,
            "ok": True,
            "reusable_tokens": 8,
            "replay_from": 8,
            "paged_tokens": 8,
            "matched_tokens": 8,
            "parts": [{"group": "mla", "first_token": 0, "tokens": 8, "size": 64, "offset": 128}],
        },
    ),
    (
        PutStateReply(id=8, stored=2, existed=0, parts=3),
        {"id": 8, "ok": True, "stored": 2, "existed": 0, "parts": 3},
    ),
    (
        RouteReply(
            id=12,
            hit_blocks=2,
            hit_tokens=32,
            hit_bytes=4096,
            load_s=0.001,
            prefill_saved_s=0.0032,
            loads_in_flight=1,
            queue_bytes=2048,
            queue_s=0.0005,
            score_s=0.0017,
        ),
        {
            "id": 12,
            "ok": True,
            "hit_blocks": 2,
            "hit_tokens": 32,
            "hit_bytes": 4096,
            "load_s": 0.001,
            "prefill_saved_s": 0.0032,
            "loads_in_flight": 1,
            "queue_bytes": 2048,
            "queue_s": 0.0005,
            "score_s": 0.0017,
        },
    ),
    (
        HotReply(
            id=9, prefixes=[HotEntry(identity=WIRE_HYBRID, tokens=TOKENS, sizes=SIZES, score=2.5)]
        ),
        {
            "id": 9,
            "ok": True,
            "prefixes": [{"identity": HYBRID_WIRE, "tokens": TOKENS, "sizes": SIZES, "score": 2.5}],
        },
    ),
    (
        PurgeReply(
            id=10,
            identities=1,
            blocks=5,
            payload_bytes=10,
            stored_bytes=12,
            dry_run=True,
            seconds=0.5,
            unknown=["tenant"],
        ),
        {
            "id": 10,
            "ok": True,
            "identities": 1,
            "blocks": 5,
            "payload_bytes": 10,
            "stored_bytes": 12,
            "dry_run": True,
            "seconds": 0.5,
            "unknown": ["tenant"],
        },
    ),
    (
        StatsReply(id=11, store={"blocks": 3}, server={"open_connections": 1}, metrics={"x": {}}),
        {
            "id": 11,
            "ok": True,
            "store": {"blocks": 3},
            "server": {"open_connections": 1},
            "metrics": {"x": {}},
        },
    ),
    (
        HealthReply(id=12, status="ok", uptime_s=1.5, connections=2, data_dir="/srv/prefixd"),
        {
            "id": 12,
            "ok": True,
            "status": "ok",
            "uptime_s": 1.5,
            "connections": 2,
            "data_dir": "/srv/prefixd",
        },
    ),
    (UnpinReply(id=13, released=2), {"id": 13, "ok": True, "released": 2}),
    (DeleteReply(id=14, blocks=3), {"id": 14, "ok": True, "blocks": 3}),
    (
        ListReply(
            id=15,
            identities=[WIRE],
            blocks=[ListedEntry(identity=0, tokens=b"\x01\x00\x00\x00", size=9)],
            next=b"\x04" * 16,
        ),
        {
            "id": 15,
            "ok": True,
            "identities": [msgpack.unpackb(msgspec.msgpack.encode(WIRE), raw=False)],
            "blocks": [[0, b"\x01\x00\x00\x00", 9]],
            "next": b"\x04" * 16,
        },
    ),
    (
        error_reply(None, ErrorCode.BAD_FRAME, "body is not a map"),
        {"id": None, "ok": False, "error": {"code": "bad_frame", "message": "body is not a map"}},
    ),
]


@pytest.mark.parametrize(("reply", "plain"), REPLY_EXAMPLES, ids=lambda v: type(v).__name__)
def test_replies_are_todays_maps(reply: Any, plain: dict[str, Any]) -> None:
    raw = encode(reply)[HEADER.size :]
    assert msgpack.unpackb(raw, raw=False) == plain
    assert decode_reply(body(plain), type(reply)) == reply  # a plain daemon's reply, typed
    assert reply_id(raw) == plain["id"]


def test_verify_reports_decode_in_both_forms() -> None:
    check = {
        "id": 1,
        "ok": True,
        "blocks": 3,
        "parts": 0,
        "problems": ["block 1: bad"],
        "by_kind": {"payload": 1},
        "count": 1,
    }
    report = decode_reply(body(check), VerifyReply)
    assert report.problems == ["block 1: bad"] and report.count == 1 and report.fixed is None
    fixed = {
        "id": 2,
        "ok": True,
        "blocks": 3,
        "parts": 0,
        "problems": ["block 1: bad"],
        "by_kind": {"payload": 1},
        "count": 1,
        "quarantined": 1,
        "fixed": 1,
        "remaining": [],
    }
    report = decode_reply(body(fixed), VerifyReply)
    assert report.problems == ["block 1: bad"] and report.fixed == 1 and report.remaining == []


def test_replies_of_old_or_newer_daemons() -> None:
    # an older daemon without the newer hello fields; a newer one with fields we do not know
    old = {
        "id": 1,
        "ok": True,
        "protocol": 1,
        "server": "prefixd/0.0.9",
        "ops": ["hello"],
        "max_frame_bytes": 1,
        "max_region_bytes": 2,
    }
    hello = decode_reply(body(old), HelloReply)
    assert hello.instance == "" and hello.models == {} and hello.max_inflight == 0
    newer = {"id": 2, "ok": True, "n_blocks": 0, "n_tokens": 0, "sizes": b"", "x": [1]}
    lookups = decode_reply(body({"id": 2, "ok": True, "results": [newer], "later": 1}), LookupReply)
    assert lookups.results == [LookupResult(n_blocks=0, n_tokens=0, sizes=b"")]


def test_error_replies_raise_the_class_of_their_code() -> None:
    cases = [
        ("open_tail", OpenTailError),
        ("bad_tokens", TokenError),
        ("bad_identity", IdentityError),
        ("bad_frame", BadFrameError),
        ("from_the_future", RemoteError),
    ]
    for code, kind in cases:
        raw = body({"id": 4, "ok": False, "error": {"code": code, "message": "why"}})
        assert reply_id(raw) == 4
        with pytest.raises(kind) as caught:
            decode_reply(raw, PutReply)
        assert isinstance(caught.value, PrefixdError) and caught.value.message == "why"
        assert decode_reply(raw, ErrorReply).error.code == code
    with pytest.raises(BadFrameError):
        decode_reply(body({"id": 1, "ok": True, "stored": "2"}), PutReply)  # no PutReply
    with pytest.raises(BadFrameError):
        decode_reply(b"\xc1", PutReply)
    with pytest.raises(BadFrameError):
        reply_id(body([1, 2]))


def test_every_reply_struct_has_an_example() -> None:
    assert {type(r) for r, _ in REPLY_EXAMPLES} | {VerifyReply} == set(REPLIES)
