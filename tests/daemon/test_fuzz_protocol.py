"""Hypothesis fuzzing of the frame decoder and of every operation's fields, all on one daemon.

Frames are random bytes, random msgpack values and requests of every op whose fields come from the
op's real field names with values of random types and sizes, among them valid-looking ones (real
identities, token ids, spans into an attached region, chain hashes), so that some succeed. Every
reply must be `ok: true` with the op's keys or `ok: false` with a known error code, never
`internal`; a well-framed frame never costs the connection. At the end the daemon still serves a
well-behaved client, logged no traceback, and its resident memory grew by less than 64 MiB.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd.client import Client
from prefixd.schema.chain import packed_hashes
from prefixd.schema.state import StateGroup
from prefixd.wire.errors import ErrorCode
from prefixd.wire.frames import HEADER, PROTOCOL_VERSION, encode_frame
from prefixd.wire.region import SharedRegion

from .conftest import (
    DEADLINE_S,
    IDENTITY,
    IDENTITY_DICT,
    Daemon,
    DaemonFactory,
    Raw,
    make_identity,
    payload,
)

MAX_FRAME = 65536
REGION = 1 << 16
TOKENS_AT = 48 << 10  # the region holds payload bytes below this and prompts' token ids from it
PROMPT_STRIDE = 1024
BT = IDENTITY.block_tokens
MAX_RSS_GROWTH = 64 << 20
N_RAW = 1500
N_MSGPACK = 1500
N_PER_OP = 150
# `verify` checks the store in a child process per request (about 0.2 s each) and has two boolean
# fields: fewer examples cover its valid, mutated and random requests as well.
N_PER_OP_OF = {"verify": 30}
N_MISFRAMED = 150

HYBRID = make_identity(
    state=(StateGroup.paged("mla", page_blocks=2), StateGroup.checkpoint("kda")),
)
HYBRID_DICT = HYBRID.to_dict()
PROMPTS = [
    np.arange(8 * BT, dtype=np.uint32) + 0x10000,
    np.concatenate([np.arange(4 * BT) + 0x10000, np.arange(4 * BT + 2) + 0x20000]).astype(
        np.uint32
    ),
    np.arange(5 * BT + 3, dtype=np.uint32) + 0x30000,
]
PACKED = [p.astype("<u4").tobytes() for p in PROMPTS]
HASHES = [packed_hashes(IDENTITY, p) for p in PROMPTS] + [packed_hashes(HYBRID, PROMPTS[0])]

OPS = (
    "hello",
    "attach",
    "put",
    "lookup",
    "load",
    "purge",
    "stats",
    "health",
    "put_state",
    "lookup_state",
    "load_state",
    "hot",
    "verify",
)
OK_KEYS = {
    "hello": {"protocol", "server", "ops", "max_frame_bytes", "max_region_bytes", "retired"},
    "attach": {"region", "size"},
    "put": {"stored", "existed"},
    "lookup": {"results"},
    "load": {"n_blocks", "n_tokens", "offsets", "sizes", "first_block"},
    "purge": {"identities", "blocks", "payload_bytes", "stored_bytes", "dry_run"},
    "stats": {"store", "server", "metrics"},
    "health": {"status", "uptime_s", "connections"},
    "put_state": {"stored", "existed", "parts"},
    "lookup_state": {"results"},
    "load_state": {"reusable_tokens", "replay_from", "paged_tokens", "matched_tokens", "parts"},
    "hot": {"prefixes"},
    "verify": {"blocks", "parts"},
}
CODES = {code.value for code in ErrorCode} - {ErrorCode.INTERNAL.value}
FRAME_CODES = {ErrorCode.BAD_FRAME.value, ErrorCode.FRAME_TOO_LARGE.value}


# --- the shared daemon and one fuzzing connection --------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS line")


class Fuzzer:
    """One raw connection (greeted, with region 1 attached) and the tally of what came back."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.sent = 0
        self.replies: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()  # successful lookups and loads that found something
        self.region = SharedRegion(REGION, name="pd-fuzz")
        rng = np.random.default_rng(7)
        self.region.view[:TOKENS_AT] = rng.integers(0, 256, TOKENS_AT, dtype=np.uint8).tobytes()
        self.conn: Raw | None = None
        self.connect()

    def connect(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = Raw(self.daemon.socket)
        self.conn.hello()
        reply = self.conn.request("attach", fds=[self.region.fd], size=REGION)
        assert reply.get("region") == 1, reply

    def restore_region(self) -> None:
        """Put the prompts' token ids back (a fuzzed load may have written over them)."""
        for i, packed in enumerate(PACKED):
            at = TOKENS_AT + i * PROMPT_STRIDE
            self.region.view[at : at + len(packed)] = packed

    def count(self, reply: dict[str, Any], op: Any = None) -> None:
        if reply.get("ok") is True:
            self.replies[f"ok:{op}"] += 1
            found = reply.get("n_blocks") or reply.get("reusable_tokens")
            found = found or any(r.get("n_blocks") for r in reply.get("results") or ())
            found = found or any(r.get("reusable_tokens") for r in reply.get("results") or ())
            if found:
                self.hits[op] += 1
        else:
            self.replies[reply["error"]["code"]] += 1

    def exchange(self, body: bytes, op: Any = None, rid: int | None = None) -> dict[str, Any]:
        """Send one well-framed body and return its one reply, checked."""
        assert self.conn is not None
        self.conn.send_body(body)
        self.sent += 1
        try:
            reply = self.conn.recv()
        except (ConnectionError, OSError) as exc:
            self.connect()
            raise AssertionError(f"no reply to a well-framed frame: {exc!r}") from None
        check_reply(reply, op, rid, oversized=len(body) > MAX_FRAME)
        self.count(reply, op)
        return reply

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.region.close()


def check_reply(
    reply: dict[str, Any], op: Any = None, rid: int | None = None, *, oversized: bool = False
) -> None:
    """`ok: true` with the op's keys, or `ok: false` with a known code (never internal)."""
    assert isinstance(reply, dict) and "ok" in reply and "id" in reply, reply
    if oversized:
        assert reply["ok"] is False and reply["error"]["code"] == "frame_too_large", reply
        return
    if reply["ok"] is True:
        assert rid is None or reply["id"] == rid, reply
        assert op in OK_KEYS, reply  # only a real op can succeed
        missing = OK_KEYS[op] - set(reply)
        assert not missing, (missing, reply)
        return
    assert reply["ok"] is False, reply
    error = reply.get("error")
    assert isinstance(error, dict), reply
    assert error.get("code") in CODES, reply
    assert isinstance(error.get("message"), str) and error["message"], reply
    if reply["id"] is None:
        assert error["code"] in FRAME_CODES, reply  # only a frame without a usable id
    elif rid is not None:
        assert reply["id"] == rid, reply


@pytest.fixture(scope="module")
def fuzz_daemon(module_daemon_factory: DaemonFactory) -> Daemon:
    return module_daemon_factory("--max-frame-bytes", str(MAX_FRAME))


def serves_well(daemon: Daemon, seed: int) -> None:
    """A well-behaved client puts, looks up and loads (its own prompt: a fuzzed purge may have
    removed anything stored before)."""
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
    tokens = np.arange(3 * BT, dtype=np.uint32) + 7_000_000 + seed * 100
    payloads = [payload(seed, i) for i in range(3)]
    with Client(daemon.socket, region_bytes=1 << 16, timeout=DEADLINE_S) as client:
        assert client.health()["status"] == "ok"
        client.put(IDENTITY, tokens, payloads)
        assert client.lookup(IDENTITY, [tokens])[0].n_blocks == 3
        loaded = client.load(IDENTITY, tokens)
        assert [bytes(v) for v in loaded.views] == payloads


class Tally:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.rss_before = rss_bytes(daemon.pid)
        self.started = time.monotonic()
        self.fuzzers: list[Fuzzer] = []
        self.misframed_sent = 0
        self.misframed_replies: Counter[str] = Counter()
        self.closed_connections = 0


@pytest.fixture(scope="module")
def tally(fuzz_daemon: Daemon) -> Tally:
    serves_well(fuzz_daemon, 1)  # warm: the store, the pool and the imports are all in use
    return Tally(fuzz_daemon)


@pytest.fixture(scope="module")
def fuzzer(fuzz_daemon: Daemon, tally: Tally) -> Iterator[Fuzzer]:
    f = Fuzzer(fuzz_daemon)
    tally.fuzzers.append(f)
    yield f
    f.close()


SETTINGS = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- value strategies -------------------------------------------------------------------------

any_int = st.one_of(
    st.integers(-5, 70_000),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    any_int,
    st.floats(allow_nan=True),
    st.text(max_size=24),
    st.binary(max_size=64),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.text(max_size=10), inner, max_size=5),
    ),
    max_leaves=12,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The plausible values of a field, or anything at all."""
    return st.one_of(strategy, strategy, anything)


prompt_index = st.integers(0, len(PROMPTS) - 1)
tokens_bin = st.one_of(
    st.sampled_from(PACKED),
    st.tuples(st.sampled_from(PACKED), st.integers(0, 200)).map(lambda t: t[0][: t[1]]),
    st.binary(max_size=300),
    st.binary(min_size=40_000, max_size=70_000),  # long: near and past the frame limit
)
tokens_span = st.one_of(
    prompt_index.map(lambda i: [1, TOKENS_AT + i * PROMPT_STRIDE, len(PROMPTS[i])]),
    st.tuples(st.integers(0, 3), st.integers(0, REGION + 10), st.integers(0, 20_000)).map(list),
    st.lists(any_int, max_size=4),
)
hashes = st.one_of(st.sampled_from(HASHES), st.binary(max_size=200))
span = st.one_of(
    st.tuples(st.just(1), st.integers(0, TOKENS_AT), st.integers(0, 4096)).map(list),
    st.tuples(st.integers(0, 3), any_int, any_int).map(list),
    st.lists(any_int, max_size=4),
)
spans = st.lists(maybe(span), max_size=10)
identity_keys = st.sampled_from([*IDENTITY_DICT, "adapter", "mm", "state", "colour"])
state_group = st.fixed_dictionaries(
    {},
    optional={
        "name": maybe(st.sampled_from(["mla", "kda", "x", ""])),
        "kind": maybe(st.sampled_from(["paged", "checkpoint", "other"])),
        "page_blocks": maybe(st.integers(0, 4)),
        "policy": maybe(st.sampled_from(["chosen", "full", "periodic", "none", "?"])),
        "period_tokens": maybe(st.integers(0, 16)),
        "replay_tokens": maybe(st.integers(0, 16)),
    },
)
identity = st.one_of(
    st.sampled_from([IDENTITY_DICT, HYBRID_DICT]),
    st.tuples(
        st.sampled_from([IDENTITY_DICT, HYBRID_DICT]),
        identity_keys,
        st.one_of(anything, st.lists(state_group, max_size=3), st.text(max_size=5000)),
    ).map(lambda t: {**t[0], t[1]: t[2]}),
    st.tuples(st.sampled_from([IDENTITY_DICT, HYBRID_DICT]), identity_keys).map(
        lambda t: {k: v for k, v in t[0].items() if k != t[1]}
    ),
    anything,
)
prompt = st.fixed_dictionaries(
    {},
    optional={
        "tokens": maybe(tokens_bin),
        "tokens_span": maybe(tokens_span),
        "n_tokens": maybe(st.integers(0, 40)),
        "hashes": maybe(hashes),
    },
)
group_names = st.one_of(st.sampled_from(["mla", "kda", "nope"]), st.text(max_size=4))
checkpoint_pairs = st.lists(
    maybe(st.tuples(maybe(st.sampled_from([0, BT, 2 * BT, 5 * BT, 8 * BT, 3])), span).map(list)),
    max_size=4,
)
hello_serves = st.lists(
    maybe(
        st.fixed_dictionaries(
            {
                "model": maybe(st.sampled_from(["m", "other", ""])),
                "weights": maybe(st.sampled_from(["w", "w2", ""])),
            }
        )
    ),
    max_size=3,
)

TOKEN_FIELDS = {
    "tokens": tokens_bin,
    "tokens_span": tokens_span,
    "n_tokens": st.integers(0, 40),
    "hashes": hashes,
}
OUTPUT_FIELDS = {
    "region": st.integers(0, 4),
    "offset": st.integers(0, REGION + 10),
    "length": st.integers(0, REGION + 10),
}
FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "hello": {
        "protocol": st.sampled_from([PROTOCOL_VERSION, 0, 2, 1 << 31]),
        "client": st.text(max_size=40),
        "serves": hello_serves,
    },
    "attach": {"size": st.sampled_from([4096, 8192, REGION, 0, 1 << 40])},
    "put": {
        "identity": identity,
        **TOKEN_FIELDS,
        "first_block": st.integers(0, 9),
        "blocks": spans,
    },
    "lookup": {"identity": identity, "prompts": st.lists(maybe(prompt), max_size=4)},
    "load": {
        "identity": identity,
        **TOKEN_FIELDS,
        **OUTPUT_FIELDS,
        "max_blocks": st.integers(0, 10),
        "first_block": st.integers(0, 9),
        "warm": st.booleans(),
    },
    "purge": {
        "dry_run": st.booleans(),
        "tenant": st.sampled_from(["a", "b", "", "\x00"]),
        "model": st.sampled_from(["m", "other", ""]),
        "keep": st.dictionaries(
            st.sampled_from(["weights", "tokenizer", "colour"]),
            st.one_of(st.none(), st.sampled_from(["w", "x"])),
            max_size=2,
        ),
        "older_than_s": st.one_of(st.floats(-1, 1e6), st.integers(-1, 10**6)),
        "everything": st.booleans(),
    },
    "stats": {},
    "health": {},
    "put_state": {
        "identity": identity,
        **TOKEN_FIELDS,
        "first_block": st.integers(0, 9),
        "upto_tokens": st.sampled_from([0, BT, 4 * BT, 8 * BT, 5, 1 << 40]),
        "paged": st.dictionaries(group_names, maybe(spans), max_size=3),
        "checkpoints": st.dictionaries(group_names, maybe(checkpoint_pairs), max_size=3),
    },
    "lookup_state": {"identity": identity, "prompts": st.lists(maybe(prompt), max_size=4)},
    "load_state": {"identity": identity, **TOKEN_FIELDS, **OUTPUT_FIELDS},
    "hot": {
        "budget_bytes": st.integers(0, 1 << 30),
        "limit": st.integers(0, 5000),
        "tenant": st.sampled_from(["a", "b", ""]),
    },
    "verify": {"fix": st.booleans(), "payloads": st.booleans()},
}


def random_request(op: str) -> st.SearchStrategy[dict[str, Any]]:
    """Any subset of the op's fields, each plausible or of any type."""
    fields = {name: maybe(strategy) for name, strategy in FIELDS[op].items()}
    fields["zzz_unknown"] = anything  # an unknown field is ignored (forward compatibility)
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def valid_request(draw: st.DrawFn, op: str) -> dict[str, Any]:
    """A request of `op` that should succeed (or fail only for the store's reasons)."""
    i = draw(prompt_index)
    hybrid = op.endswith("_state")
    ident = HYBRID_DICT if hybrid else IDENTITY_DICT
    if draw(st.booleans()):
        tokens: dict[str, Any] = {"tokens": PACKED[i]}
    else:
        tokens = {"tokens_span": [1, TOKENS_AT + i * PROMPT_STRIDE, len(PROMPTS[i])]}
    if draw(st.booleans()):
        tokens["n_tokens"] = len(PROMPTS[i])
    closed = len(PROMPTS[i]) // BT
    payload_span = st.tuples(
        st.just(1), st.integers(0, TOKENS_AT - 4096), st.integers(1, 4096)
    ).map(list)
    if op == "put":
        first = draw(st.integers(0, closed - 1))
        n = draw(st.integers(1, closed - first))
        blocks = draw(st.lists(payload_span, min_size=n, max_size=n))
        return {"identity": ident, **tokens, "first_block": first, "blocks": blocks}
    if op in ("lookup", "lookup_state"):
        prompts = []
        for j in draw(st.lists(prompt_index, min_size=1, max_size=3)):
            entry: dict[str, Any] = {"tokens": PACKED[j]}
            if not hybrid and draw(st.booleans()):
                entry["hashes"] = HASHES[j]
            prompts.append(entry)
        return {"identity": ident, "prompts": prompts}
    if op in ("load", "load_state"):
        message = {"identity": ident, **tokens, "region": 1}
        message["offset"] = draw(st.integers(0, TOKENS_AT - 8192))
        if draw(st.booleans()):
            message["length"] = draw(st.integers(0, 8192))
        if op == "load" and draw(st.booleans()):
            message["max_blocks"] = draw(st.integers(0, closed))
        if op == "load" and draw(st.booleans()):
            message["warm"] = True
        return message
    if op == "put_state":
        pages = draw(st.lists(payload_span, min_size=4, max_size=4))
        message = {"identity": ident, "tokens": PACKED[0], "upto_tokens": 8 * BT}
        message["paged"] = {"mla": pages}
        if draw(st.booleans()):
            boundary = draw(st.sampled_from([BT, 2 * BT, 5 * BT, 8 * BT]))
            message["checkpoints"] = {"kda": [[boundary, draw(payload_span)]]}
        return message
    if op == "hello":
        return {"protocol": PROTOCOL_VERSION, "client": draw(st.text(max_size=20))}
    if op == "attach":
        return {"size": 4096}
    if op == "purge":
        return {"dry_run": draw(st.booleans()), "tenant": draw(st.sampled_from(["a", "b"]))}
    if op == "hot":
        return {"budget_bytes": draw(st.integers(0, 1 << 20)), "tenant": "a"}
    if op == "verify":
        return {"fix": draw(st.booleans())}
    return {}


def request_of(op: str) -> st.SearchStrategy[dict[str, Any]]:
    """Valid requests, valid ones with a field or two of any type, and random field sets."""
    valid = valid_request(op)
    mutated = st.tuples(valid, random_request(op)).map(
        lambda t: {**t[0], **dict(list(t[1].items())[:2])}
    )
    return st.one_of(valid, mutated, random_request(op))


# --- raw bodies -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scale(long_run: bool) -> int:
    """How many times the default number of examples to run (`--long`: ten)."""
    return 10 if long_run else 1


def test_random_bytes_as_a_body(fuzzer: Fuzzer, scale: int) -> None:
    @settings(SETTINGS, max_examples=N_RAW * scale)
    @given(body=st.one_of(st.binary(max_size=64), st.binary(max_size=4096)))
    def run(body: bytes) -> None:
        fuzzer.exchange(body)

    run()


def test_random_msgpack_values_as_a_body(fuzzer: Fuzzer, scale: int) -> None:
    """Any msgpack value; half the time a map with a (maybe valid) id and a random op."""

    @settings(SETTINGS, max_examples=N_MSGPACK * scale)
    @given(value=anything, as_map=st.booleans(), rid=st.one_of(st.none(), any_int, anything))
    def run(value: Any, as_map: bool, rid: Any) -> None:
        if as_map:
            value = {"id": rid, "op": value} if rid is not None else {"op": value}
        try:
            body = msgpack.packb(value, use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            return  # not encodable (an int past 64 bits)
        op = value.get("op") if isinstance(value, dict) else None
        fuzzer.exchange(body, op if isinstance(op, str) else None)

    run()


misframed = st.lists(
    st.one_of(
        st.tuples(st.binary(max_size=200), st.integers(-50, 50)),  # a length off by a bit
        st.tuples(st.binary(max_size=20), st.just(MAX_FRAME * 64 + 1)),  # cannot be skipped
        st.tuples(st.binary(max_size=20), st.integers(MAX_FRAME + 1, MAX_FRAME * 2)),
    ),
    min_size=1,
    max_size=4,
)


def test_misframed_streams(fuzz_daemon: Daemon, tally: Tally, scale: int) -> None:
    """Lengths that lie, bodies cut short, half a header: whatever the daemon answers is a known
    error, and it closes the connection at the latest when we stop writing."""

    @settings(SETTINGS, max_examples=N_MISFRAMED * scale)
    @given(frames=misframed, tail=st.binary(max_size=3))
    def run(frames: list[tuple[bytes, int]], tail: bytes) -> None:
        stream = b""
        for body, delta in frames:
            claimed = delta if delta > MAX_FRAME else max(0, len(body) + delta)
            stream += HEADER.pack(claimed) + body
        stream += tail  # part of a header, maybe
        with Raw(fuzz_daemon.socket, timeout=DEADLINE_S) as conn:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.sock.sendall(stream)
                conn.sock.shutdown(socket.SHUT_WR)
            tally.misframed_sent += len(frames)
            while True:
                try:
                    reply = conn.recv()
                except (ConnectionError, OSError, ValueError, msgpack.UnpackException):
                    break
                check_reply(reply)
                key = "ok" if reply["ok"] else reply["error"]["code"]
                tally.misframed_replies[key] += 1
            assert conn.closed_by_peer(timeout=DEADLINE_S), (
                "the daemon kept a connection we stopped writing"
            )
            tally.closed_connections += 1

    run()


# --- every op, with fields of every type ------------------------------------------------------


@pytest.mark.parametrize("op", [*OPS, "random"])
def test_every_op_with_random_fields(fuzzer: Fuzzer, scale: int, op: str) -> None:
    if op == "random":
        ops = st.one_of(st.text(max_size=12), st.sampled_from([o.upper() for o in OPS]))
        fields = st.dictionaries(
            st.sampled_from(sorted({n for f in FIELDS.values() for n in f})), anything, max_size=6
        )
    else:
        ops, fields = st.just(op), request_of(op)
    attach_fds = st.sampled_from(["none", "memfd", "memfd", "two", "pipe"])

    @settings(SETTINGS, max_examples=N_PER_OP_OF.get(op, N_PER_OP) * scale)
    @given(name=ops, message=fields, fds=attach_fds)
    def run(name: str, message: dict[str, Any], fds: str) -> None:
        fuzzer.restore_region()
        assert fuzzer.conn is not None
        fuzzer.conn._next += 1
        rid = fuzzer.conn._next
        full = {**message, "id": rid, "op": name}
        frame = encode_frame(full)
        sent_fds, opened = [], []
        if name == "attach" and fds != "none":
            if fds == "pipe":
                r, w = os.pipe()
                opened, sent_fds = [r, w], [r]
            else:
                regions = [SharedRegion(4096 * (1 + k)) for k in range(1 if fds == "memfd" else 2)]
                opened = regions
                sent_fds = [r.fd for r in regions]
        try:
            if len(frame) - HEADER.size > MAX_FRAME:
                fuzzer.exchange(frame[HEADER.size :], name, rid)
                return
            fuzzer.conn.send(full, sent_fds)
            fuzzer.sent += 1
            try:
                reply = fuzzer.conn.recv()
            except (ConnectionError, OSError) as exc:
                fuzzer.connect()
                raise AssertionError(f"{name}: no reply to a well-framed request") from exc
        finally:
            for item in opened:
                if isinstance(item, int):
                    os.close(item)
                else:
                    item.close()
        check_reply(reply, name, rid)
        fuzzer.count(reply, name)

    run()


# --- afterwards -------------------------------------------------------------------------------


def test_the_daemon_survived_and_stayed_small(fuzz_daemon: Daemon, tally: Tally) -> None:
    serves_well(fuzz_daemon, 2)
    for fuzzer in tally.fuzzers:
        assert fuzzer.conn is not None
        assert fuzzer.conn.request("health")["status"] == "ok"  # the fuzzing connection too
    with Raw(fuzz_daemon.socket) as conn:
        conn.hello()
        stats = conn.request("stats")
    grown = rss_bytes(fuzz_daemon.pid) - tally.rss_before
    sent = sum(f.sent for f in tally.fuzzers)
    replies: Counter[str] = Counter()
    hits: Counter[str] = Counter()
    for fuzzer in tally.fuzzers:
        replies.update(fuzzer.replies)
        hits.update(fuzzer.hits)
    by_code = Counter({k: v for k, v in replies.items() if not k.startswith("ok:")})
    oks = Counter({k[3:]: v for k, v in replies.items() if k.startswith("ok:")})
    print(
        f"\nfuzz: {sent} frames on one connection + {tally.misframed_sent} misframed on "
        f"{tally.closed_connections} connections in {time.monotonic() - tally.started:.1f} s; "
        f"ok {sum(oks.values())} {dict(oks.most_common())} (hits {dict(hits)}); "
        f"errors {dict(by_code.most_common())}; misframed replies {dict(tally.misframed_replies)}; "
        f"RSS grew {grown / 2**20:.1f} MiB"
    )
    assert sent >= N_RAW + N_MSGPACK, (
        "this module's tests ran in several processes: --dist loadfile"
    )
    assert sum(oks.values()) >= 100, "too few fuzzed requests succeeded to reach the store"
    assert hits["load"] and hits["lookup"], "no fuzzed load or lookup found anything stored"
    assert stats["server"].get("errors.internal", 0) == 0, fuzz_daemon.log()
    log = fuzz_daemon.log()
    assert "Traceback" not in log, log[-5000:]
    assert "internal" not in log.lower(), log[-5000:]
    assert grown < MAX_RSS_GROWTH, f"the daemon grew by {grown >> 20} MiB"
