"""Hostile and broken input on raw sockets: every case gets the right error, the connection stays
usable where the protocol says so, and a well-behaved client keeps working throughout."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from prefixd import Store
from prefixd.client import Client
from prefixd.daemon.context import Request
from prefixd.daemon.operations import Operations
from prefixd.daemon.peer import Peer
from prefixd.daemon.session import MAX_REGIONS_PER_CONNECTION
from prefixd.errors import ProtocolError
from prefixd.schema.chain import chain_hashes, packed_hashes
from prefixd.wire.errors import ErrorCode, code_of
from prefixd.wire.frames import HEADER, encode_frame
from prefixd.wire.messages import Attach
from prefixd.wire.region import SharedRegion, send_with_fds

from .conftest import (
    DEADLINE_S,
    IDENTITY,
    IDENTITY_DICT,
    NOBODY,
    Daemon,
    DaemonFactory,
    Raw,
    as_nobody,
    error_of,
    payload,
    wait_for,
)
from .test_loop_work import services

MAX_FRAME = 65536
BT = IDENTITY.block_tokens
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def packed(ids: list[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


GOOD_TOKENS = np.arange(3 * BT, dtype=np.uint32) + 4242
GOOD_PAYLOADS = [payload(4242, i) for i in range(3)]


class Good:
    """A well-behaved Client on the same daemon; `check()` proves it is still fully served."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.client = Client(daemon.socket, region_bytes=1 << 16, timeout=DEADLINE_S)
        self.client.put(IDENTITY, GOOD_TOKENS, GOOD_PAYLOADS)

    def check(self) -> None:
        assert self.daemon.proc is not None and self.daemon.proc.poll() is None, self.daemon.log()
        assert self.client.health()["status"] == "ok"
        loaded = self.client.load(IDENTITY, GOOD_TOKENS)
        assert [bytes(v) for v in loaded.views] == GOOD_PAYLOADS
        assert self.client.lookup(IDENTITY, [GOOD_TOKENS])[0].n_blocks == 3


@pytest.fixture(scope="module")
def shared(module_daemon_factory: DaemonFactory) -> Daemon:
    return module_daemon_factory("--max-frame-bytes", str(MAX_FRAME), "--log-level", "debug")


@pytest.fixture
def good(shared: Daemon) -> Iterator[Good]:
    g = Good(shared)
    yield g
    g.check()
    g.client.close()


@pytest.fixture
def raw(shared: Daemon) -> Iterator[Raw]:
    with Raw(shared.socket) as conn:
        yield conn


def assert_usable(conn: Raw) -> None:
    """The same connection still answers a valid request (hello if it never said it)."""
    reply = conn.request("hello", protocol=1)
    assert reply["ok"] is True, reply
    assert conn.request("health")["status"] == "ok"


def expect(reply: dict[str, Any], code: str, *names: str) -> str:
    got, message = error_of(reply)
    assert got == code, reply
    for name in names:
        assert name in message, (name, message)
    return message


def test_forged_hashes_serve_no_other_prefix_then_or_later(good: Good) -> None:
    client = good.client
    mine = np.arange(6 * BT, dtype=np.uint32) + 7000
    theirs = np.concatenate([np.full(4 * BT, 7, dtype=np.uint32), mine[4 * BT : 5 * BT]])
    client.put(IDENTITY, mine[: 4 * BT], [payload(7000, i) for i in range(4)])
    client.put(IDENTITY, theirs, [payload(7, i) for i in range(5)])
    assert client.lookup(IDENTITY, [mine[: 4 * BT]])[0].n_blocks == 4  # now remembered
    ours, other = chain_hashes(IDENTITY, mine), chain_hashes(IDENTITY, theirs)
    forged = b"".join([*ours[:3], other[3], other[4], ours[3]])
    assert client.lookup(IDENTITY, [mine], hashes=[forged])[0].n_blocks <= 4
    loaded = client.load(IDENTITY, mine[: 5 * BT])  # an honest client, after the forged lookup
    assert [bytes(v) for v in loaded.views] == [payload(7000, i) for i in range(4)]


# --- frames that are not requests -----------------------------------------------------------------

NOT_MSGPACK = [
    b"\xc1",  # the one byte msgpack never uses
    b"\x92\x01",  # an array of two holding one item
    b"",  # an empty body
    b"\xdb\xff\xff\xff\xff",  # a str claiming 4 GiB
    msgpack.packb({"id": 1, "op": "health"}) + b"\x00",  # trailing bytes
    b"\x91" * 5000 + b"\xc0",  # nested deeper than the unpacker allows
    msgpack.packb({1: 2}),  # a map key that is not a str
]
NOT_A_MAP = [msgpack.packb(v) for v in ([1, 2], 5, "health", None, b"\x00\x01", True, 1.5)]
NO_ID = [
    msgpack.packb(m)
    for m in (
        {"op": "health"},
        {"id": "1", "op": "health"},
        {"id": -1, "op": "health"},
        {"id": True, "op": "health"},
        {"id": 1.0, "op": "health"},
        {"id": 2**64 - 1, "op": "health"},
        {"id": None, "op": "health"},
    )
]


@pytest.mark.parametrize("body", NOT_MSGPACK + NOT_A_MAP + NO_ID)
def test_a_body_that_is_no_request_is_bad_frame(raw: Raw, good: Good, body: bytes) -> None:
    raw.send_body(body)
    reply = raw.recv()
    expect(reply, "bad_frame")
    assert reply["id"] is None
    assert_usable(raw)
    good.check()


@pytest.mark.parametrize("op", [None, 5, b"health", ["health"], {"x": 1}])
def test_a_request_without_a_str_op_is_bad_frame_with_its_id(raw: Raw, good: Good, op: Any) -> None:
    message: dict[str, Any] = {"id": 77}
    if op is not None:
        message["op"] = op
    raw.send(message)
    reply = raw.recv()
    assert reply["id"] == 77
    expect(reply, "bad_frame", "op")
    assert_usable(raw)
    good.check()


def test_hello_unknown_ops_and_versions(raw: Raw, good: Good) -> None:
    expect(raw.request("health"), "hello_required")
    expect(raw.request("lookup", identity=IDENTITY_DICT, prompts=[]), "hello_required")
    expect(raw.request("hello", protocol=99), "unsupported_version", "99")
    expect(raw.request("hello"), "bad_request", "protocol")
    expect(raw.request("hello", protocol="1"), "bad_request", "protocol")
    expect(raw.request("stats"), "hello_required")  # a failed hello greets nobody
    message = expect(raw.request("frobnicate"), "unknown_op", "frobnicate")
    long_op = expect(raw.request("x" * 10_000), "unknown_op")
    assert len(long_op) < 200, "the message quotes at most a bounded part of the op"
    assert message
    raw.hello()
    expect(raw.request("Health"), "unknown_op")
    expect(raw.request(""), "unknown_op")
    assert raw.request("hello", protocol=1)["ok"] is True  # hello again is fine
    good.check()


# --- fields of the wrong type ---------------------------------------------------------------------


def _base(op: str) -> dict[str, Any]:
    tokens = packed(GOOD_TOKENS)
    if op == "put":
        return {"identity": IDENTITY_DICT, "tokens": tokens, "blocks": [[1, 0, 8]]}
    if op == "lookup":
        return {"identity": IDENTITY_DICT, "prompts": [{"tokens": tokens}]}
    return {"identity": IDENTITY_DICT, "tokens": tokens, "region": 1}


WRONG_FIELDS = [
    ("put", {"identity": "m"}, "bad_identity", "identity"),
    ("lookup", {"identity": ["m"]}, "bad_identity", "identity"),
    ("load", {"identity": None}, "bad_identity", "identity"),
    ("put", {"tokens": "1 2 3 4"}, "bad_tokens", "tokens"),
    ("put", {"tokens": [1, 2, 3, 4]}, "bad_tokens", "tokens"),
    ("load", {"tokens": None}, "bad_tokens", "tokens"),
    ("put", {"first_block": "0"}, "bad_request", "first_block"),
    ("put", {"first_block": -1}, "bad_request", "first_block"),
    ("put", {"first_block": 1.0}, "bad_request", "first_block"),
    ("put", {"blocks": {"0": [1, 0, 8]}}, "bad_request", "blocks"),
    ("put", {"blocks": b"\x01\x00\x08"}, "bad_request", "blocks"),
    ("put", {"blocks": [[1, -5, 8]]}, "bad_request", "blocks[0]"),
    ("put", {"blocks": [[1, 0, 8], [1, 8, -8]]}, "bad_request", "blocks[1]"),
    ("put", {"blocks": [[1, 0]]}, "bad_request", "blocks[0]"),
    ("put", {"blocks": [[True, 0, 8]]}, "bad_request", "blocks[0]"),
    ("put", {"blocks": [[1, 0, "8"]]}, "bad_request", "blocks[0]"),
    ("put", {"blocks": ["x"]}, "bad_request", "blocks[0]"),
    ("lookup", {"prompts": "x"}, "bad_request", "prompts"),
    ("lookup", {"prompts": None}, "bad_request", "prompts"),
    ("lookup", {"prompts": [5]}, "bad_request", "prompts[0]"),
    ("lookup", {"prompts": [{"tokens": b""}, {"tokens": 5}]}, "bad_tokens", "tokens"),
    ("lookup", {"prompts": [{"tokens": b"", "hashes": "ab"}]}, "bad_tokens", "hashes"),
    ("lookup", {"prompts": [{"tokens_span": [1, -1, 2]}]}, "bad_request", "prompts[0].tokens_span"),
    ("lookup", {"prompts": [{"tokens_span": "1,0,2"}]}, "bad_request", "tokens_span"),
    ("load", {"region": "1"}, "bad_request", "region"),
    ("load", {"offset": -1}, "bad_request", "offset"),
    ("load", {"length": "all"}, "bad_request", "length"),
    ("load", {"max_blocks": "3"}, "bad_request", "max_blocks"),
    ("load", {"hashes": 5}, "bad_tokens", "hashes"),
]


@pytest.mark.parametrize(("op", "change", "code", "name"), WRONG_FIELDS)
def test_wrong_field_types(
    raw: Raw, good: Good, op: str, change: dict[str, Any], code: str, name: str
) -> None:
    raw.hello()
    region = SharedRegion(1 << 12)
    try:
        assert raw.request("attach", fds=[region.fd], size=region.size)["region"] == 1
    finally:
        region.close()
    message = {**_base(op), **change}
    message = {k: v for k, v in message.items() if v is not None}
    expect(raw.request(op, **message), code, name)
    assert_usable(raw)
    good.check()


def test_attach_field_types(raw: Raw, good: Good) -> None:
    raw.hello()
    with SharedRegion(4096) as region:
        expect(raw.request("attach", fds=[region.fd], size="4096"), "bad_request", "size")
        expect(raw.request("attach", fds=[region.fd]), "bad_request", "size")
        expect(raw.request("attach", fds=[region.fd], size=0), "bad_request", "size")
        expect(raw.request("attach", fds=[region.fd], size=2**62), "bad_request", "size")
        assert raw.request("attach", fds=[region.fd], size=4096)["ok"] is True
    assert_usable(raw)
    good.check()


# --- invalid identities ---------------------------------------------------------------------------

BAD_IDENTITIES = [
    ({"model": ""}, "model"),
    ({"tenant": ""}, "tenant"),
    ({"model": 5}, "model"),
    ({"model": ["m"]}, "model"),
    ({"weights": None}, "weights"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"block_tokens": -4}, "block_tokens"),
    ({"block_tokens": "4"}, "block_tokens"),
    ({"block_tokens": 1 << 40}, "block_tokens"),
    ({"colour": "blue"}, "colour"),
    ({"adapter": ""}, "adapter"),
    ({"mm": 3}, "mm"),
    ({"model": "x" * 5000}, "model"),
]


@pytest.mark.parametrize(("change", "name"), BAD_IDENTITIES)
def test_invalid_identity_names_the_field(
    raw: Raw, good: Good, change: dict[str, Any], name: str
) -> None:
    raw.hello()
    identity = {**IDENTITY_DICT, **change}
    if change.get("weights", 1) is None:
        del identity["weights"]  # a missing required field
    for op, fields in (
        ("lookup", {"prompts": [{"tokens": packed(GOOD_TOKENS)}]}),
        ("put", {"tokens": packed(GOOD_TOKENS), "blocks": []}),
        ("load", {"tokens": packed(GOOD_TOKENS), "region": 1}),
    ):
        expect(raw.request(op, identity=identity, **fields), "bad_identity", name)
    assert_usable(raw)
    good.check()


@pytest.mark.parametrize(
    ("value", "valid"), [(4.0, 4), (True, 1), (1.0, 1)], ids=["float", "bool", "float1"]
)
def test_identity_types_are_checked_even_once_cached(
    raw: Raw, good: Good, value: Any, valid: int
) -> None:
    """The daemon caches parsed identities; a cache hit must not skip validation (4.0 == 4)."""
    raw.hello()
    prompt = {"tokens": packed(GOOD_TOKENS)}
    ok = raw.request("lookup", identity={**IDENTITY_DICT, "block_tokens": valid}, prompts=[prompt])
    assert ok["ok"] is True, ok
    bad = raw.request("lookup", identity={**IDENTITY_DICT, "block_tokens": value}, prompts=[prompt])
    expect(bad, "bad_identity", "block_tokens")
    good.check()


# --- token arrays ---------------------------------------------------------------------------------


def test_bad_token_arrays(raw: Raw, good: Good) -> None:
    raw.hello()
    with SharedRegion(1 << 12) as region:
        assert raw.request("attach", fds=[region.fd], size=region.size)["region"] == 1
    seven = packed(GOOD_TOKENS)[:7]
    cases = [
        ("lookup", {"prompts": [{"tokens": seven}]}, "not a multiple of 4"),
        ("lookup", {"prompts": [{"tokens": packed([1, 2]), "n_tokens": 3}]}, "n_tokens"),
        ("lookup", {"prompts": [{"tokens": packed([1, 2]), "n_tokens": "2"}]}, "n_tokens"),
        ("lookup", {"prompts": [{"tokens": b"", "tokens_span": [1, 0, 1]}]}, "tokens_span"),
        ("lookup", {"prompts": [{"n_tokens": 0}]}, "tokens"),
        ("put", {"tokens": seven, "blocks": [[1, 0, 8]]}, "multiple of 4"),
        ("put", {"tokens": packed(GOOD_TOKENS), "n_tokens": 11, "blocks": [[1, 0, 8]]}, "n_tokens"),
        ("load", {"tokens": seven, "region": 1}, "multiple of 4"),
        ("load", {"tokens": packed(GOOD_TOKENS), "n_tokens": 13, "region": 1}, "n_tokens"),
        ("load", {"tokens_span": [1, 0, 4], "n_tokens": 5, "region": 1}, "n_tokens"),
        # Hashes that do not fit the prompt's closed blocks.
        ("load", {"tokens": packed(GOOD_TOKENS), "hashes": b"\x00" * 15, "region": 1}, "hash"),
        ("lookup", {"prompts": [{"tokens": packed(GOOD_TOKENS), "hashes": b"\x01" * 32}]}, "hash"),
    ]
    for op, fields, name in cases:
        expect(raw.request(op, identity=IDENTITY_DICT, **fields), "bad_tokens", name)
    assert_usable(raw)
    good.check()


# --- puts the store refuses -----------------------------------------------------------------------


def test_open_tail_orphan_and_empty_payloads_store_nothing(raw: Raw, good: Good) -> None:
    raw.hello()
    tokens = np.arange(2 * BT + 2, dtype=np.uint32) + 31337
    with SharedRegion(1 << 12) as region:
        assert raw.request("attach", fds=[region.fd], size=region.size)["region"] == 1
    put = {"identity": IDENTITY_DICT, "tokens": packed(tokens)}
    expect(raw.request("put", **put, blocks=[[1, 0, 8]] * 3), "open_tail")
    expect(raw.request("put", **put, first_block=2, blocks=[[1, 0, 8]]), "open_tail")
    expect(raw.request("put", **put, first_block=1, blocks=[[1, 0, 8]]), "orphan")
    expect(raw.request("put", **put, first_block=0, blocks=[[1, 0, 8], [1, 8, 0]]), "bad_payload")
    found = raw.request("lookup", identity=IDENTITY_DICT, prompts=[{"tokens": packed(tokens)}])
    assert found["results"][0]["n_blocks"] == 0, "a refused put stored something"
    # The same put, done right, works on the same connection.
    assert raw.request("put", **put, blocks=[[1, 0, 8], [1, 8, 8]])["stored"] == 2
    expect(raw.request("put", **put, first_block=3, blocks=[[1, 0, 8]]), "open_tail")
    good.check()


# --- regions --------------------------------------------------------------------------------------


def test_spans_outside_the_region_and_unknown_regions(raw: Raw, good: Good) -> None:
    raw.hello()
    size = 1 << 16
    with SharedRegion(size) as region:
        assert raw.request("attach", fds=[region.fd], size=size)["region"] == 1
    tokens = packed(GOOD_TOKENS)
    base = {"identity": IDENTITY_DICT, "tokens": tokens}
    cases = [
        ("put", {**base, "blocks": [[1, size - 10, 11]]}),
        ("put", {**base, "blocks": [[1, size, 1]]}),
        ("put", {**base, "blocks": [[1, 2**61, 2**61]]}),
        ("put", {**base, "blocks": [[2, 0, 8]]}),
        ("put", {**base, "blocks": [[0, 0, 8]]}),
        ("load", {**base, "region": 1, "offset": size + 1}),
        ("load", {**base, "region": 1, "offset": 10, "length": size}),
        ("load", {**base, "region": 1, "offset": 2**61, "length": 2**61}),
        ("load", {**base, "region": 7}),
        ("load", {**base, "region": 0}),
        ("lookup", {"identity": IDENTITY_DICT, "prompts": [{"tokens_span": [1, size - 4, 2]}]}),
        ("lookup", {"identity": IDENTITY_DICT, "prompts": [{"tokens_span": [3, 0, 2]}]}),
    ]
    for op, fields in cases:
        expect(raw.request(op, **fields), "bad_region")
    # A span of more token ids than a prompt may hold is refused before the region is looked at.
    huge = {"identity": IDENTITY_DICT, "tokens_span": [1, 0, 2**40], "region": 1}
    expect(raw.request("load", **huge), "bad_tokens")
    # A region of another connection is not this one's.
    with Raw(good.daemon.socket) as other:
        other.hello()
        expect(other.request("load", **base, region=1), "bad_region")
    assert_usable(raw)
    good.check()


def test_a_put_may_not_name_more_bytes_than_its_regions_hold(raw: Raw, good: Good) -> None:
    """Spans may overlap (blocks of the same bytes), but a put naming its region many times over
    would have a small frame store far more than the region carries."""
    raw.hello()
    size = 1 << 12
    with SharedRegion(size) as region:
        assert raw.request("attach", fds=[region.fd], size=size)["region"] == 1
    tokens = np.arange(3 * BT, dtype=np.uint32) + 77_000
    put = {"identity": IDENTITY_DICT, "tokens": packed(tokens)}
    expect(raw.request("put", **put, blocks=[[1, 0, size]] * 3), "bad_region", "more than")
    found = raw.request("lookup", identity=IDENTITY_DICT, prompts=[{"tokens": packed(tokens)}])
    assert found["results"][0]["n_blocks"] == 0
    stored = raw.request("put", **put, blocks=[[1, 0, size // 4]] * 2 + [[1, 8, 8]])
    assert stored.get("stored") == 3, stored
    good.check()


def test_a_request_naming_one_prompt_many_times_is_bounded_in_blocks(raw: Raw, good: Good) -> None:
    """A lookup's prompts may all name the same span of token ids: their closed blocks together are bounded,
    so the reply (8 bytes per hit block) stays within what a client reads."""
    raw.hello()
    n = 2049
    with SharedRegion(1 << 16) as region:
        region.view[: 4 * n] = packed(np.arange(n) + 5)
        assert raw.request("attach", fds=[region.fd], size=region.size)["region"] == 1
    identity = {**IDENTITY_DICT, "block_tokens": 1}
    prompts = [{"tokens_span": [1, 0, n]}] * 2048  # 4,196,352 blocks
    found = raw.request("lookup", identity=identity, prompts=prompts, stored_only=True)
    expect(found, "bad_tokens", "closed blocks")
    assert len(raw.request("lookup", identity=identity, prompts=prompts[:2000])["results"]) == 2000
    good.check()


def test_a_purge_older_than_no_finite_age_is_refused(raw: Raw, good: Good) -> None:
    raw.hello()
    for age in (float("nan"), float("inf"), 1e300):
        expect(raw.request("purge", older_than_s=age, dry_run=True), "bad_request", "older_than")
    assert raw.request("purge", older_than_s=3600.0, dry_run=True)["ok"] is True
    good.check()


def _memfds(daemon: Daemon) -> list[str]:
    """Every descriptor the daemon holds (its connections are the same before and after)."""
    return daemon.open_fds()


def test_attach_refuses_what_is_no_sealed_memfd(
    raw: Raw, good: Good, shared: Daemon, tmp_path: Path
) -> None:
    raw.hello()
    before = _memfds(shared)
    size = 1 << 12
    plain = tmp_path / "plain-file"
    plain.write_bytes(bytes(size))
    unsealable = os.memfd_create("pd-unsealable")  # no MFD_ALLOW_SEALING: it can never be sealed
    os.ftruncate(unsealable, size)
    unsealed = os.memfd_create("pd-unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, size)
    shrink_only = os.memfd_create("pd-shrink", os.MFD_ALLOW_SEALING)
    os.ftruncate(shrink_only, size)
    fcntl.fcntl(shrink_only, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    r1, w1 = os.pipe()
    left, right = socket.socketpair()
    sealed = SharedRegion(size)
    try:
        with open(plain, "r+b") as file:
            cases = [
                ([], size, "exactly one"),
                ([file.fileno()], size, "memfd"),
                ([unsealable], size, "seal"),
                ([unsealed], size, "seal"),
                ([shrink_only], size, "seal"),
                ([r1], size, "memfd"),
                ([left.fileno()], size, "memfd"),
                ([sealed.fd], size * 2, "size"),  # smaller than claimed
                ([sealed.fd], size // 2, "size"),
                ([sealed.fd, sealed.fd], size, "exactly one"),
            ]
            for fds, claimed, words in cases:
                expect(raw.request("attach", fds=fds, size=claimed), "bad_region", words)
                assert_usable(raw)
        after = _memfds(shared)
        assert after == before, "the daemon kept a descriptor it refused"
        # The connection and the daemon are fine: a proper region attaches.
        assert raw.request("attach", fds=[sealed.fd], size=size)["ok"] is True
    finally:
        for fd in (unsealable, unsealed, shrink_only, r1, w1):
            os.close(fd)
        left.close()
        right.close()
        sealed.close()
    good.check()


@pytest.mark.parametrize("seal", [fcntl.F_SEAL_WRITE, F_SEAL_FUTURE_WRITE], ids=["write", "future"])
def test_attach_refuses_a_write_sealed_memfd(
    raw: Raw, good: Good, shared: Daemon, seal: int
) -> None:
    """The daemon maps regions read-write; a memfd sealed against writing is the client's error
    (bad_region), not the daemon's (internal)."""
    raw.hello()
    before = _memfds(shared)
    fd = os.memfd_create("pd-write-sealed", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | seal)
        expect(raw.request("attach", fds=[fd], size=4096), "bad_region")
    finally:
        os.close(fd)
    assert _memfds(shared) == before
    assert_usable(raw)
    good.check()


def test_descriptors_belong_to_the_frame_they_came_with(
    raw: Raw, good: Good, shared: Daemon
) -> None:
    """Two attaches sent back to back, each with its own memfd, both succeed; a descriptor that
    came with another frame is not taken by a later attach that brought none."""
    raw.hello()
    first, second, stray = SharedRegion(4096), SharedRegion(8192), SharedRegion(4096)
    try:
        send_with_fds(raw.sock, encode_frame({"id": 1, "op": "attach", "size": 4096}), [first.fd])
        send_with_fds(raw.sock, encode_frame({"id": 2, "op": "attach", "size": 8192}), [second.fd])
        replies = {r["id"]: r for r in (raw.recv(), raw.recv())}
        send_with_fds(raw.sock, encode_frame({"id": 3, "op": "health"}), [stray.fd])
        assert raw.recv()["ok"] is True
        orphaned = raw.request("attach", size=4096)
    finally:
        first.close()
        second.close()
        stray.close()
    assert replies[1]["ok"] is True and replies[2]["ok"] is True, replies
    assert replies[1]["size"] == 4096 and replies[2]["size"] == 8192
    expect(orphaned, "bad_region")
    good.check()


def test_attaches_under_way_together_count_against_the_region_limit(tmp_path: Path) -> None:
    """Attaches a connection pipelines all pass the check before any has mapped its region: each
    one under way counts, so a connection never holds more than its limit of regions."""
    with (
        Store.open(tmp_path / "s", map_size=16 << 20) as store,
        ThreadPoolExecutor(2) as pool,
        SharedRegion(1 << 16) as region,
    ):
        ops = Operations(services(store, pool))
        peer = Peer(NOBODY, max_inflight=64)
        context, attach = ops.context(peer), ops.handlers[Attach]

        async def attach_all() -> list[object]:
            requests = [
                Request(i, Attach(id=i, size=region.size), (os.dup(region.fd),)) for i in range(24)
            ]
            return await asyncio.gather(
                *(attach.run(context, r) for r in requests), return_exceptions=True
            )

        answers = asyncio.run(attach_all())
        refused = [a for a in answers if isinstance(a, ProtocolError)]
        assert len(peer.regions) == MAX_REGIONS_PER_CONNECTION == len(answers) - len(refused)
        assert all(code_of(a) is ErrorCode.BAD_REGION for a in refused)
        peer.close_regions()


# --- frame sizes ----------------------------------------------------------------------------------


def test_an_oversized_frame_is_refused_and_skipped(raw: Raw, good: Good) -> None:
    raw.hello()
    # The body is itself made of valid frames: had the daemon not skipped it, they would be
    # answered (and the stream would be out of step).
    inner = encode_frame({"id": 5, "op": "health"})
    body = (inner * (100 * 1024 // len(inner) + 1))[: 100 * 1024]
    raw.sock.sendall(HEADER.pack(len(body)) + body)
    reply = raw.recv()
    assert reply["id"] is None
    expect(reply, "frame_too_large", str(MAX_FRAME))
    assert_usable(raw)  # the next replies are ours: nothing from inside the skipped body
    # Just within the limit is accepted (a bad_frame: padding is not msgpack, but it is read).
    raw.send_body(b"\xc1" * MAX_FRAME)
    expect(raw.recv(), "bad_frame")
    # The largest body the daemon still skips: 64 times the limit.
    raw.sock.sendall(HEADER.pack(64 * MAX_FRAME) + bytes(64 * MAX_FRAME))
    expect(raw.recv(), "frame_too_large")
    assert_usable(raw)
    good.check()


@pytest.mark.parametrize("claimed", [2**32 - 1, 64 * MAX_FRAME + 1])
def test_a_frame_claiming_gigabytes_closes_the_connection(
    raw: Raw, good: Good, shared: Daemon, claimed: int
) -> None:
    raw.hello()
    raw.sock.sendall(HEADER.pack(claimed) + b"\x00" * 1000)
    reply = raw.recv()
    assert reply["id"] is None
    expect(reply, "frame_too_large")
    assert raw.closed_by_peer(), "the daemon kept a connection it cannot resynchronise"
    good.check()
    with Raw(shared.socket) as fresh:
        assert_usable(fresh)


def test_a_truncated_frame_leaves_the_daemon_unaffected(good: Good, shared: Daemon) -> None:
    with Raw(shared.socket) as conn:
        conn.hello()
        conn.sock.sendall(HEADER.pack(1000) + b"\x82" + b"\x00" * 9)
        good.check()  # served while that connection waits for the rest
    with Raw(shared.socket) as conn:
        conn.sock.sendall(HEADER.pack(1000)[:2])  # not even a whole header
    with Raw(shared.socket) as conn:
        conn.hello()
        conn.sock.sendall(HEADER.pack(1000) + b"\x00" * 10)
        conn.sock.shutdown(socket.SHUT_WR)
        assert conn.closed_by_peer()
    wait_for(
        lambda: good.client.stats()["server"]["open_connections"] == 1,
        "half-read connections closed",
    )
    good.check()


def test_a_flood_of_garbage_frames_is_answered_one_by_one(raw: Raw, good: Good) -> None:
    kinds = [
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"id": "x"}),
        msgpack.packb({"id": 9, "op": 9}),
        msgpack.packb({"id": 10, "op": "nope"}),
        msgpack.packb({"id": 11, "op": "lookup"}),  # before hello
        b"\x92",
    ]
    frames = [kinds[i % len(kinds)] for i in range(200)]
    raw.sock.sendall(b"".join(HEADER.pack(len(f)) + f for f in frames))
    good.check()
    codes = []
    for _ in frames:
        reply = raw.recv()
        assert reply["ok"] is False, reply
        codes.append(reply["error"]["code"])
    assert set(codes) <= {"bad_frame", "unknown_op", "hello_required", "busy"}
    assert codes.count("bad_frame") >= 200 * 4 // 7
    assert_usable(raw)
    good.check()


def test_the_shared_daemon_logged_no_internal_error(shared: Daemon, good: Good) -> None:
    good.check()
    stats = good.client.stats()["server"]
    assert stats.get("errors.internal", 0) == 0, shared.log()
    assert "Traceback" not in shared.log()


# --- logs -----------------------------------------------------------------------------------------

SECRET = 987654321


def test_logs_hold_no_prompts_tokens_or_keys(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--log-level", "debug")
    secret_prompts = [
        np.array([SECRET + i for i in range(5 * BT + 1)], dtype=np.uint32),
        np.array([SECRET] * (3 * BT), dtype=np.uint32),
        np.array([SECRET - 1] * 4500, dtype=np.uint32),  # long: through the token region
    ]
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        for prompt in secret_prompts:
            n_blocks = len(prompt) // BT
            pays = [payload(SECRET, i) for i in range(n_blocks)]
            client.put(IDENTITY, prompt, pays)
            hashes = [packed_hashes(IDENTITY, prompt), None]
            client.lookup(IDENTITY, [prompt, prompt[:BT]], hashes=hashes)
            client.load(IDENTITY, prompt)
    with Raw(daemon.socket) as conn:
        conn.hello()
        tokens = packed(secret_prompts[0])
        ident = {"identity": IDENTITY_DICT}
        requests = [
            ("put", {**ident, "tokens": tokens, "blocks": [[1, 0, 8]]}),
            ("lookup", {**ident, "prompts": [{"tokens": tokens, "n_tokens": SECRET}]}),
            ("lookup", {**ident, "prompts": [{"tokens": tokens[:-1]}]}),
            ("lookup", {**ident, "prompts": [{"tokens": tokens, "hashes": b"\x00"}]}),
            ("load", {"identity": IDENTITY_DICT, "tokens": tokens, "region": SECRET}),
            ("lookup", {"identity": {**IDENTITY_DICT, "model": str(SECRET)}, "prompts": "x"}),
            ("lookup", {"identity": {**IDENTITY_DICT, "block_tokens": SECRET}, "prompts": []}),
            (str(SECRET), {}),
        ]
        for op, fields in requests:
            assert conn.request(op, **fields)["ok"] is False
        conn.send_body(tokens)  # raw token bytes as a frame body
        assert conn.recv()["ok"] is False
        conn.sock.sendall(HEADER.pack(2**31) + tokens)
        assert conn.recv()["ok"] is False
    with Raw(daemon.socket) as conn:  # cut off mid-frame: logged at debug
        conn.sock.sendall(HEADER.pack(len(tokens) + 8) + tokens)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, secret_prompts[1], [payload(1, i) for i in range(3)])  # existed
    assert daemon.stop() == 0
    log = daemon.log()
    assert "serving" in log and "DEBUG" in log, "debug logging did not run"
    forbidden = {str(SECRET), str(SECRET - 1), str(SECRET + 1)}
    for prompt in secret_prompts:
        raw_bytes = packed(prompt)
        forbidden.add(raw_bytes[:8].hex())
        forbidden.add(raw_bytes[:4].hex())
        forbidden.add(raw_bytes[:8].hex(" "))
        for i in range(0, len(raw_bytes) // 16 * 16, 16 * 97):
            forbidden.add(raw_bytes[i : i + 4].hex())
        hashes = packed_hashes(IDENTITY, prompt)
        for i in range(0, len(hashes), 16):
            forbidden.add(hashes[i : i + 16].hex())
            forbidden.add(hashes[i : i + 4].hex())  # short forms like "block 1a2b3c4d.."
    forbidden.add(IDENTITY.digest.hex())
    forbidden.add(IDENTITY.digest[:4].hex())
    leaked = sorted(s for s in forbidden if s.lower() in log.lower())
    assert not leaked, f"the log shows {leaked}:\n{log}"


def _shmem_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise AssertionError("no Shmem line in /proc/meminfo")


def test_attaching_a_sparse_region_allocates_nothing(raw: Raw, good: Good) -> None:
    """The daemon maps a region without populating it: a client cannot make it allocate memory
    by attaching a large, untouched memfd."""
    raw.hello()
    size = 512 << 20
    fd = os.memfd_create("pd-sparse", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        before = _shmem_kib()
        reply = raw.request("attach", fds=[fd], size=size)
        grown = _shmem_kib() - before
    finally:
        os.close(fd)
    assert reply["ok"] is True, reply
    assert grown < (size >> 10) // 4, f"attaching a sparse region allocated {grown} KiB"
    good.check()


def test_prompts_past_the_token_limits_are_refused_before_any_work(
    daemon_factory: DaemonFactory,
) -> None:
    """A lookup naming more token ids than `--max-prompt-tokens` (one prompt) or
    `--max-request-tokens` (all its prompts) is refused with a clear error before the ids are
    read or hashed; an honest client beside it is answered."""
    from prefixd.errors import TokenError

    daemon = daemon_factory("--max-prompt-tokens", "65536", "--max-request-tokens", "131072")
    bt = IDENTITY.block_tokens
    ok = np.arange(1024 * bt, dtype=np.uint32)
    with Client(daemon.socket, region_bytes=1 << 20, token_region_bytes=8 << 20) as client:
        client.put(IDENTITY, ok[: 4 * bt], [b"x" * 64] * 4)
        with pytest.raises(TokenError, match=r"at most 65536 per prompt \(max_prompt_tokens\)"):
            client.lookup(IDENTITY, [np.zeros(65536 + bt, dtype=np.uint32)])
        with pytest.raises(TokenError, match=r"at most 131072 per request"):
            client.lookup(IDENTITY, [np.zeros(60000, dtype=np.uint32)] * 3)
        with pytest.raises(TokenError, match="max_prompt_tokens"):
            client.load(IDENTITY, np.zeros(70000, dtype=np.uint32))
        assert client.lookup(IDENTITY, [ok])[0].n_blocks == 4  # within the limits: answered

        # and an honest client beside a flood of them is answered throughout
        import threading
        import time

        stop = threading.Event()

        def flood() -> None:
            with Client(daemon.socket, token_region_bytes=8 << 20) as attacker:
                while not stop.is_set():
                    with contextlib.suppress(TokenError):
                        attacker.lookup(IDENTITY, [np.zeros(65536 + bt, dtype=np.uint32)] * 2)

        attackers = [threading.Thread(target=flood) for _ in range(2)]
        for thread in attackers:
            thread.start()
        latencies = []
        try:
            for _ in range(200):
                started = time.perf_counter()
                assert client.lookup(IDENTITY, [ok])[0].n_blocks == 4
                latencies.append(time.perf_counter() - started)
        finally:
            stop.set()
            for thread in attackers:
                thread.join()
        latencies.sort()
        assert latencies[int(len(latencies) * 0.99)] < 2.0


def test_a_client_that_pipelines_without_reading_meets_backpressure(daemon: Daemon) -> None:
    """The attack: thousands of pipelined lookups and never a read, then a disconnect. The
    daemon stops reading that connection at --max-inflight requests (no `busy` reply and no task
    per excess frame: the client's own sends block), an honest client beside it is answered
    throughout, and the disconnect costs only what was in flight."""
    import threading
    import time

    bt = IDENTITY.block_tokens
    prompt = np.arange(64 * bt, dtype=np.uint32)
    with Client(daemon.socket, region_bytes=1 << 20) as honest:
        honest.put(IDENTITY, prompt, [b"p" * 256] * 64)
        flood = Raw(daemon.socket)
        flood.request("hello", protocol=1, client="flood")
        frame = encode_frame(
            {"op": "lookup", "id": 7, "identity": IDENTITY.to_dict(),
             "prompts": [{"tokens": prompt.tobytes()}]}
        )  # fmt: skip
        sent = [0]

        def pipeline() -> None:
            try:
                for _ in range(20_000):
                    flood.sock.sendall(frame)
                    sent[0] += 1
            except OSError:
                pass  # closed under it

        flood.sock.settimeout(None)
        sender = threading.Thread(target=pipeline)
        sender.start()
        latencies = []
        for _ in range(200):
            started = time.perf_counter()
            assert honest.lookup(IDENTITY, [prompt])[0].n_blocks == 64
            latencies.append(time.perf_counter() - started)
        stalled = sent[0] < 20_000  # its sends block: the daemon reads no more than it serves
        flood.sock.shutdown(socket.SHUT_RDWR)
        flood.close()
        sender.join(DEADLINE_S)
        started = time.perf_counter()
        assert honest.lookup(IDENTITY, [prompt])[0].n_blocks == 64  # the disconnect: no stall
        after_close = time.perf_counter() - started
        server = honest.stats()["server"]
    assert stalled
    assert server.get("errors.busy", 0) == 0
    latencies.sort()
    assert latencies[int(len(latencies) * 0.99)] < 2.0, latencies[-5:]
    assert after_close < 2.0


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM line in the daemon's status")


def test_frames_that_would_decode_to_millions_of_objects_are_refused_unbuilt(
    daemon: Daemon,
) -> None:
    """The attacks: a put_state naming 32 groups of 65,536 checkpoints each (12 MiB of msgpack,
    2 million entries, which built would hold about 270 MiB and the loop for a second), and a
    request carrying 16 million empty arrays in a field no request has. The first is refused for
    its total before one entry is built, the second is skipped unbuilt; the daemon's peak memory
    grows by less than one such frame would take, and an honest client beside the flood is
    answered throughout."""
    import threading
    import time

    bt = IDENTITY.block_tokens
    prompt = np.arange(64 * bt, dtype=np.uint32)
    groups = 32
    checkpoints = {f"g{i}": [[0, [0, 0, 0]]] * 65536 for i in range(groups)}
    spans = encode_frame(
        {"op": "put_state", "id": 9, "identity": IDENTITY_DICT, "tokens": b"",
         "checkpoints": checkpoints}
    )  # fmt: skip
    junk = encode_frame({"op": "health", "id": 10, "junk": [[]] * 16_000_000})
    assert len(spans) < 16 << 20 and len(junk) < 16 << 20  # within the default frame limit
    replies: list[dict[str, Any]] = []
    with Client(daemon.socket, region_bytes=1 << 20) as honest:
        honest.put(IDENTITY, prompt, [b"p" * 256] * 64)
        before = _peak_rss_kib(daemon.pid)

        def flood() -> None:
            with Raw(daemon.socket, timeout=DEADLINE_S) as attacker:
                attacker.hello()
                for _ in range(6):
                    attacker.sock.sendall(spans)
                    attacker.sock.sendall(junk)
                replies.extend(attacker.recv() for _ in range(12))

        attackers = [threading.Thread(target=flood) for _ in range(2)]
        for thread in attackers:
            thread.start()
        latencies = []
        while any(t.is_alive() for t in attackers) or len(latencies) < 20:
            started = time.perf_counter()
            assert honest.lookup(IDENTITY, [prompt])[0].n_blocks == 64
            latencies.append(time.perf_counter() - started)
        for thread in attackers:
            thread.join(DEADLINE_S)
        grown_mib = (_peak_rss_kib(daemon.pid) - before) >> 10
    refused = [r for r in replies if r["id"] == 9]
    assert len(refused) == 12 and len(replies) == 24
    for reply in refused:
        expect(reply, "bad_request", "at most 65536 payloads")
    assert all(r["ok"] for r in replies if r["id"] == 10)
    assert grown_mib < 128, f"the daemon's peak memory grew by {grown_mib} MiB"
    latencies.sort()
    assert latencies[int(len(latencies) * 0.99)] < 2.0, latencies[-5:]


def test_verifies_run_one_at_a_time_apart_from_lookups(daemon: Daemon) -> None:
    """The attack: verify after verify, pipelined. One runs (on a thread of its own), the others
    are refused as busy at once, and an honest client's lookups are answered meanwhile."""
    import threading
    import time

    bt = IDENTITY.block_tokens
    prompt = np.arange(128 * bt, dtype=np.uint32)
    with Client(daemon.socket, region_bytes=16 << 20) as honest:
        honest.put(IDENTITY, prompt, [payload(1, i, 64 << 10) for i in range(128)])
        replies: list[dict[str, Any]] = []
        with Raw(daemon.socket, timeout=DEADLINE_S) as admin:
            admin.hello()

            def verifies() -> None:
                for rid in range(16):
                    admin.send({"op": "verify", "id": 5000 + rid})
                replies.extend(admin.recv() for _ in range(16))

            flood = threading.Thread(target=verifies)
            flood.start()
            latencies = []
            while flood.is_alive() and len(latencies) < 2000:
                started = time.perf_counter()
                assert honest.lookup(IDENTITY, [prompt])[0].n_blocks == 128
                latencies.append(time.perf_counter() - started)
            flood.join(DEADLINE_S)
    codes = [r["error"]["code"] if not r["ok"] else "ok" for r in replies]
    assert codes.count("ok") >= 1 and codes.count("busy") >= 1, codes
    assert set(codes) <= {"ok", "busy"}
    latencies.sort()
    assert latencies and latencies[int(len(latencies) * 0.99)] < 2.0


def test_purges_queue_on_the_admin_thread_apart_from_lookups_and_loads(
    daemon_factory: DaemonFactory,
) -> None:
    """The attack: purge after purge, pipelined, on a daemon with one worker. They run one at a
    time on the administrative thread, so an honest client's request that needs a worker is
    answered while they are still queued, not after all of them."""
    import select

    daemon = daemon_factory("--workers", "1")
    bt = IDENTITY.block_tokens
    prompts = [np.arange(8192 * bt, dtype=np.uint32) + k * 10_000_000 for k in range(4)]
    with Client(daemon.socket, region_bytes=1 << 20) as honest:
        for prompt in prompts:
            honest.put(IDENTITY, prompt, [b"p" * 16] * 8192)
        with Raw(daemon.socket, timeout=DEADLINE_S) as admin:
            admin.hello()
            for rid in range(8):
                admin.send({"op": "purge", "id": 7000 + rid, "everything": True, "dry_run": True})
            first = admin.recv()  # one purge done: the other seven are under way
            assert honest.health()["status"] == "ok"  # needs the worker
            readable, _, _ = select.select([admin.sock], [], [], 0)
            waiting = not readable
            rest = [admin.recv() for _ in range(7)]
    assert first["ok"] and first["blocks"] == 4 * 8192, first
    assert all(r["ok"] for r in rest), rest
    assert waiting, "the honest request was answered only after every purge"


# --- peers that hold connections --------------------------------------------------------------


def test_silent_slow_and_idle_connections_are_closed(daemon_factory: DaemonFactory) -> None:
    """The attacks: a connection that never says hello, one that sends half a frame (a
    slowloris, or a header promising a body that never comes), and one that idles. Each is
    closed within its timeout; an honest client is answered throughout."""
    daemon = daemon_factory(
        "--handshake-timeout-s", "1", "--frame-timeout-s", "1", "--idle-timeout-s", "2"
    )  # fmt: skip
    import threading
    import time

    stop, latencies, errors = threading.Event(), [], []

    def answered() -> None:  # an honest client of its own, beside the attack all along
        with Client(daemon.socket, timeout=DEADLINE_S) as client:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    assert client.health()["status"] == "ok"
                except Exception as exc:  # noqa: BLE001 - counted, then asserted on
                    errors.append(repr(exc))
                latencies.append(time.perf_counter() - started)
                stop.wait(0.01)

    beside = threading.Thread(target=answered)
    beside.start()
    with Client(daemon.socket) as honest:
        silent = Raw(daemon.socket)
        half = Raw(daemon.socket)
        half.hello()
        half.sock.sendall(HEADER.pack(1000) + b"x" * 10)  # and never the rest
        header_only = Raw(daemon.socket)
        header_only.hello()
        header_only.sock.sendall(HEADER.pack(MAX_FRAME))
        idle = Raw(daemon.socket)
        idle.hello()
        for attacker in (silent, half, header_only):
            assert attacker.closed_by_peer(timeout=DEADLINE_S)
            attacker.close()
        assert honest.health()["status"] == "ok"
        assert idle.closed_by_peer(timeout=DEADLINE_S)  # after 2 s without a request
        idle.close()
        assert honest.stats()["server"]["timeouts"] >= 4
    stop.set()
    beside.join(DEADLINE_S)
    assert not errors and len(latencies) > 10, errors[:3]
    latencies.sort()
    assert latencies[int(len(latencies) * 0.99)] < 2.0, latencies[-5:]


def test_one_uid_cannot_hold_every_connection(daemon_factory: DaemonFactory) -> None:
    """The attack: one peer opening connection after connection. Past
    --max-connections-per-uid it is refused (busy, at once, never left hanging); a closed one
    makes room again."""
    daemon = daemon_factory("--max-connections-per-uid", "8")
    held = [Raw(daemon.socket) for _ in range(8)]
    for conn in held:
        conn.hello()
    with Raw(daemon.socket) as extra:
        reply = extra.recv()
        assert reply["error"]["code"] == "busy" and "at most 8" in reply["error"]["message"]
    held.pop().close()
    wait_for(lambda: _answers(daemon.socket), "room for another connection")
    for conn in held:
        conn.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as a second user (uid 65534)")
def test_a_peer_holding_every_connection_it_may_leaves_room_for_other_users(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    """The attack: one uid opens as many connections as the daemon serves. Past its share it is
    refused, so another user's client still connects and is answered throughout."""
    import time

    os.chmod(sock_dir, 0o711)
    daemon = daemon_factory(
        "--max-connections", "16", "--max-connections-per-uid", "8",
        "--allowed-uids", str(NOBODY), "--socket-mode", "0666",
    )  # fmt: skip
    held = [Raw(daemon.socket, timeout=DEADLINE_S) for _ in range(16)]
    answers = []
    for conn in held:
        with contextlib.suppress(BrokenPipeError):  # a refused one may be closed already
            conn.send({"id": 1, "op": "hello", "protocol": 1})
        answers.append(conn.recv())  # the refused are told at once, never left hanging

    def honest() -> list[float]:
        latencies = []
        for _ in range(50):
            with Client(daemon.socket, timeout=DEADLINE_S, daemon_uid=0) as client:
                started = time.perf_counter()
                assert client.health()["status"] == "ok"
                latencies.append(time.perf_counter() - started)
        return sorted(latencies)

    try:
        kind, latencies = as_nobody(honest)
    finally:
        for conn in held:
            conn.close()
    assert kind == "ok", latencies  # another user was served while the first held its share
    assert [a["ok"] for a in answers].count(True) == 8
    assert all("at most 8" in a["error"]["message"] for a in answers if not a["ok"])
    assert latencies[int(len(latencies) * 0.99)] < 2.0, latencies[-5:]


def _answers(path: Path) -> bool:
    with Raw(path) as conn:
        try:
            return bool(conn.hello())
        except (ConnectionError, AssertionError, KeyError):
            return False


def test_a_daemon_out_of_descriptors_answers_new_clients(daemon_factory: DaemonFactory) -> None:
    """The attack: connections until the daemon has no file descriptor left. A new client is
    told so at once (busy) instead of hanging unanswered, and the daemon recovers when they go."""
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(hard, 96)
    launcher = ["prlimit", f"--nofile={low}:{hard}", sys.executable, "-m", "prefixd"]
    daemon = daemon_factory("--max-connections-per-uid", "4096", launcher=launcher)
    flood: list[socket.socket] = []
    try:
        for _ in range(low + 16):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(daemon.socket))
            flood.append(conn)
        with Raw(daemon.socket, timeout=DEADLINE_S) as late:
            late.sock.settimeout(DEADLINE_S)
            try:
                reply = late.recv()
                assert reply["error"]["code"] == "busy"
            except ConnectionError:
                pass  # closed at once: also an answer, not a hang
    finally:
        for conn in flood:
            conn.close()
    wait_for(lambda: _answers(daemon.socket), "the daemon to serve again")
