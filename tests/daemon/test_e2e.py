"""End to end: the real daemon in a subprocess, driven by the real clients."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixd.client import AsyncClient, Client, Lookup
from prefixd.errors import RegionFullError
from prefixd.schema.chain import packed_hashes

from .conftest import DEADLINE_S, IDENTITY, REPO, Daemon, DaemonFactory, payload, wait_for

BT = IDENTITY.block_tokens


def tokens(seed: int, n: int) -> np.ndarray:
    """`n` distinctive token ids (well above any real vocabulary, all different per seed)."""
    return (np.arange(n, dtype=np.uint32) * 7 + seed * 1_000_003 + 500_000_000).astype(np.uint32)


def block_payloads(seed: int, n_blocks: int, size: int | None = None) -> list[bytes]:
    return [payload(seed, i, size or 64 + 37 * (i % 11)) for i in range(n_blocks)]


def _views(loaded) -> list[bytes]:
    return [bytes(v) for v in loaded.views]


# --- one client: put, lookup, load -------------------------------------------------------------


def test_put_lookup_load_with_the_blocking_client(daemon: Daemon) -> None:
    a = tokens(1, 10 * BT + 2)  # 10 closed blocks and an open tail of 2 tokens
    pays = block_payloads(1, 10)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert client.server["protocol"] == 1
        assert client.put(IDENTITY, a, pays).stored == 10
        again = client.put(IDENTITY, a, pays)
        assert (again.stored, again.existed) == (0, 10)

        b = np.concatenate([a[: 6 * BT], tokens(2, 3 * BT)])  # shares 6 blocks with a
        miss = tokens(3, 5 * BT)
        short = a[: BT - 1]  # only an open tail
        results = client.lookup(IDENTITY, [a, b, miss, short, a[: 4 * BT]])
        sizes = tuple(len(p) for p in pays)
        assert results == [
            Lookup(10, 40, sizes),
            Lookup(6, 24, sizes[:6]),
            Lookup(0, 0, ()),
            Lookup(0, 0, ()),
            Lookup(4, 16, sizes[:4]),
        ]

        loaded = client.load(IDENTITY, a)
        assert (loaded.n_blocks, loaded.n_tokens) == (10, 40)
        assert _views(loaded) == pays
        assert loaded.offsets[0] == 0
        ends = [o + n for o, n in zip(loaded.offsets, loaded.sizes)]
        assert ends[:-1] == list(loaded.offsets[1:])  # back to back

        partial = client.load(IDENTITY, b)  # `loaded` still holds its span: this one is elsewhere
        assert partial.n_blocks == 6 and partial.offsets[0] >= ends[-1]
        assert _views(partial) == pays[:6]
        # The bytes are really in the region where the reply says.
        start = partial.offsets[0]
        assert bytes(client.region.view[start : start + sizes[0]]) == pays[0]
        loaded.release()
        with pytest.raises(ValueError):  # a released view raises instead of showing new bytes
            bytes(loaded.views[0])

        assert _views(client.load(IDENTITY, a, max_blocks=3)) == pays[:3]
        fits_two = client.load(IDENTITY, a, length=sizes[0] + sizes[1] + 1)
        assert fits_two.n_blocks == 2 and _views(fits_two) == pays[:2]
        assert client.load(IDENTITY, miss).n_blocks == 0

        # Client-supplied chain hashes give the same answers; wrong ones are a miss (or, when the
        # daemon recognises the prompt from memory, the true answer), never a wrong answer.
        hashes = [packed_hashes(IDENTITY, p) for p in (a, b, miss)]
        assert client.lookup(IDENTITY, [a, b, miss], hashes=hashes) == results[:3]
        assert client.lookup(IDENTITY, [a, b], hashes=[None, hashes[1]]) == results[:2]
        assert _views(client.load(IDENTITY, a, hashes=hashes[0])) == pays
        wrong = bytes(len(hashes[0]))
        assert client.lookup(IDENTITY, [a], hashes=[wrong]) in ([Lookup(0, 0, ())], results[:1])
        wrong_load = client.load(IDENTITY, a, hashes=wrong)
        assert wrong_load.n_blocks in (0, 10) and _views(wrong_load) == pays[: wrong_load.n_blocks]

        # Extending a stored prefix from its first missing block.
        longer = np.concatenate([a[: 10 * BT], tokens(4, 2 * BT)])
        more = block_payloads(4, 2)
        assert client.put(IDENTITY, longer, more, first_block=10).stored == 2
        assert _views(client.load(IDENTITY, longer)) == pays + more


def test_a_hit_larger_than_the_whole_region_is_refused_not_an_empty_load(daemon: Daemon) -> None:
    """A client whose region cannot hold a stored block's payload (stored by a client with a
    larger region) is told so, by both clients, where a load would otherwise come back empty
    like a miss; a `length` the caller chose is its own bound, answered as before."""
    prompt, pays = tokens(5, 2 * BT), block_payloads(5, 2, size=96 << 10)
    with Client(daemon.socket, region_bytes=1 << 20) as writer:
        assert writer.put(IDENTITY, prompt, pays).stored == 2
    with Client(daemon.socket, region_bytes=64 << 10) as small:
        with pytest.raises(
            RegionFullError, match="98304 bytes are needed at once, the region holds 65536"
        ):
            small.load(IDENTITY, prompt)
        assert small.load(IDENTITY, prompt, length=32 << 10).n_blocks == 0
        assert small.region_usage().leased_bytes == 0

    async def async_load() -> None:
        async with AsyncClient(daemon.socket, region_bytes=64 << 10) as small:
            with pytest.raises(RegionFullError, match="98304 bytes are needed at once"):
                await small.load(IDENTITY, prompt)

    asyncio.run(async_load())


def test_long_prompts_use_the_token_region_and_agree_with_inline(daemon: Daemon) -> None:
    n_blocks = 1100  # 4400 tokens = 17600 bytes of ids, past the 16 KiB inline limit
    long = tokens(10, n_blocks * BT + 3)
    pays = block_payloads(10, n_blocks, size=48)
    with (
        Client(daemon.socket, region_bytes=1 << 20) as spans,
        Client(daemon.socket, region_bytes=1 << 20, token_region_bytes=0) as inline,
    ):
        # The first client really sends long prompts through its token region, the second inline.
        held: list[Any] = []
        assert spans._core.prompt_fields(long, held)["tokens_span"] is not None
        assert inline._core.prompt_fields(long, [])["tokens_span"] is None
        held[0].release()

        assert spans.put(IDENTITY, long, pays).stored == n_blocks
        other = np.concatenate([long[: 1000 * BT], tokens(11, 100 * BT)])
        prompts = [long, other, long[: 5 * BT], tokens(12, 4500), long[:-3]]
        via_spans = spans.lookup(IDENTITY, prompts)
        via_inline = inline.lookup(IDENTITY, prompts)
        assert via_spans == via_inline
        assert [r.n_blocks for r in via_spans] == [n_blocks, 1000, 5, 0, n_blocks]
        hashes = [packed_hashes(IDENTITY, p) for p in prompts]
        assert spans.lookup(IDENTITY, prompts, hashes=hashes) == via_spans
        assert inline.lookup(IDENTITY, prompts, hashes=hashes) == via_spans

        assert _views(spans.load(IDENTITY, long)) == pays
        assert _views(inline.load(IDENTITY, long)) == pays
        assert _views(spans.load(IDENTITY, other, hashes=hashes[1])) == pays[:1000]

        # A put of a long prompt made inline is found through the token region, and back.
        long2 = tokens(13, 1200 * BT)
        pays2 = block_payloads(13, 1200, size=32)
        assert inline.put(IDENTITY, long2, pays2).stored == 1200
        assert spans.lookup(IDENTITY, [long2])[0].n_blocks == 1200
        assert _views(spans.load(IDENTITY, long2)) == pays2


def test_async_client(daemon: Daemon) -> None:
    prompts = [tokens(20 + k, 6 * BT + 1) for k in range(8)]
    pays = [block_payloads(20 + k, 6) for k in range(8)]
    long = tokens(40, 4200)  # inline: the async client has no token region

    async def scenario() -> None:
        async with AsyncClient(daemon.socket, region_bytes=1 << 20) as client:
            for prompt, pay in zip(prompts, pays):
                assert (await client.put(IDENTITY, prompt, pay)).stored == 6
            long_pays = block_payloads(40, 1050, size=16)
            assert (await client.put(IDENTITY, long, long_pays)).stored == 1050
            # Many requests in flight on one connection; loads into disjoint parts of the region.
            lookups = await asyncio.gather(
                *(client.lookup(IDENTITY, [p, p[: 3 * BT], tokens(99, 9)]) for p in prompts)
            )
            for result, pay in zip(lookups, pays):
                assert [r.n_blocks for r in result] == [6, 3, 0]
                assert result[0].sizes == tuple(len(x) for x in pay)
            loads = await asyncio.gather(*(client.load(IDENTITY, p, length=8192) for p in prompts))
            for loaded, pay in zip(loads, pays):
                assert _views(loaded) == pay
            hashes = [packed_hashes(IDENTITY, p) for p in prompts]
            with_hashes = await client.lookup(IDENTITY, prompts, hashes=hashes)
            assert with_hashes == [r[0] for r in lookups]
            assert (await client.lookup(IDENTITY, [long]))[0].n_blocks == 1050
            assert _views(await client.load(IDENTITY, long)) == long_pays
            assert (await client.health())["status"] == "ok"

    asyncio.run(scenario())


def test_async_client_concurrent_puts_store_the_right_payloads(daemon: Daemon) -> None:
    """Puts in flight together on one AsyncClient must not clobber each other's staged payloads."""
    prompts = [tokens(50 + k, 2 * BT) for k in range(8)]
    pays = [block_payloads(50 + k, 2, size=512) for k in range(8)]

    async def scenario() -> list[list[bytes]]:
        async with AsyncClient(daemon.socket, region_bytes=1 << 20) as client:
            await asyncio.gather(*(client.put(IDENTITY, p, x) for p, x in zip(prompts, pays)))
            return [_views(await client.load(IDENTITY, p)) for p in prompts]

    assert asyncio.run(scenario()) == pays


# --- restarts ------------------------------------------------------------------------------------


def test_restart_keeps_the_store_and_clients_reconnect(daemon: Daemon) -> None:
    a = tokens(60, 12 * BT)
    b = np.concatenate([a[: 5 * BT], tokens(61, 2 * BT)])
    long = tokens(62, 1050 * BT)
    pays = block_payloads(60, 12)
    long_pays = block_payloads(62, 1050, size=24)

    client = Client(daemon.socket, region_bytes=1 << 20)
    loop = asyncio.new_event_loop()
    try:
        aclient = loop.run_until_complete(AsyncClient.connect(daemon.socket, region_bytes=1 << 16))
        client.put(IDENTITY, a, pays)
        client.put(IDENTITY, long, long_pays)
        before = client.lookup(IDENTITY, [a, b, long])
        assert [r.n_blocks for r in before] == [12, 5, 1050]

        daemon.restart()

        # The same Client object: its next call reconnects and succeeds.
        assert client.lookup(IDENTITY, [a, b, long]) == before
        assert _views(client.load(IDENTITY, a)) == pays
        assert _views(client.load(IDENTITY, long)) == long_pays
        assert _views(client.load(IDENTITY, b, length=1 << 16)) == pays[:5]
        assert loop.run_until_complete(aclient.lookup(IDENTITY, [a, b, long])) == before
        loaded = loop.run_until_complete(aclient.load(IDENTITY, a))
        assert _views(loaded) == pays

        daemon.restart()  # and once more, with puts right after
        c = tokens(63, 3 * BT)
        assert client.put(IDENTITY, c, block_payloads(63, 3)).stored == 3
        stats = client.stats()
        assert stats["store"]["blocks"] == 12 + 1050 + 3
        assert stats["server"]["requests.put"] == 1  # counters are this process's
        loop.run_until_complete(aclient.close())
    finally:
        client.close()
        loop.close()
    assert daemon.exit_codes == [0, 0]


# --- many clients --------------------------------------------------------------------------------


def _chain_payload(hashes: bytes, index: int) -> bytes:
    """A payload fixed by the block's chain position, so clients putting the same block agree."""
    h = hashes[index * 16 : (index + 1) * 16]
    return h * (8 + index % 5)


def test_sixteen_concurrent_clients(daemon: Daemon) -> None:
    n_clients, rounds = 16, 6
    base = tokens(70, 8 * BT)  # every prompt starts with these 8 blocks
    errors: list[BaseException] = []
    counts = {"puts": 0, "stored": 0, "existed": 0, "loads": 0, "lookups": 0}
    lock = threading.Lock()
    barrier = threading.Barrier(n_clients)

    def prompt(worker: int, r: int) -> np.ndarray:
        # Workers share `base`; pairs of workers also share their first own block.
        own = tokens(100 + worker // 2, BT)
        return np.concatenate([base, own, tokens(1000 + worker * rounds + r, (r % 3 + 1) * BT)])

    def work(worker: int) -> None:
        try:
            with Client(daemon.socket, region_bytes=1 << 16) as client:
                barrier.wait(DEADLINE_S)
                for r in range(rounds):
                    p = prompt(worker, r)
                    hashes = packed_hashes(IDENTITY, p)
                    n = len(p) // BT
                    pays = [_chain_payload(hashes, i) for i in range(n)]
                    result = client.put(IDENTITY, p, pays)
                    assert result.stored + result.existed == n
                    loaded = client.load(IDENTITY, p)
                    assert loaded.n_blocks == n and _views(loaded) == pays
                    found = client.lookup(IDENTITY, [p, p[: 9 * BT], base[:-1]])
                    assert [x.n_blocks for x in found] == [n, 9, 7]
                    with lock:
                        counts["puts"] += 1
                        counts["stored"] += result.stored
                        counts["existed"] += result.existed
                        counts["loads"] += 1
                        counts["lookups"] += 1
                barrier.wait(DEADLINE_S)
                # Everyone's prompts are visible to everyone.
                others = [prompt((worker + k) % n_clients, rounds - 1) for k in range(n_clients)]
                for p, x in zip(others, client.lookup(IDENTITY, others)):
                    assert x.n_blocks == len(p) // BT
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]

    # base, one own block per pair of workers, per-round blocks (2 on average)
    unique = 8 + n_clients // 2 + n_clients * rounds * 2
    with Client(daemon.socket) as observer:
        stats = observer.stats()
    store, server = stats["store"], stats["server"]
    assert counts["stored"] == store["blocks"] == unique
    assert server["requests.put"] == counts["puts"] == n_clients * rounds
    assert server["requests.load"] == counts["loads"]
    assert server["requests.lookup"] == counts["lookups"] + n_clients
    assert server["requests.hello"] == server["connections"] == n_clients + 1
    assert server["open_connections"] == 1
    assert not any(k.startswith("errors.") for k in server)
    assert store["loaded_blocks"] >= counts["loads"] * 9
    assert store["payload_bytes"] > 0 and store["identities"] == 1


# --- a client dying mid-transfer -----------------------------------------------------------------

HAMMER = """
import sys, numpy as np
from prefixd.client import Client
from tests.daemon.conftest import IDENTITY
client = Client(sys.argv[1], region_bytes=8 << 20)
n = 0
while True:
    toks = (np.arange(4 * 16, dtype=np.uint32) + n % 3 * 1000 + 7).astype(np.uint32)
    pays = [bytes([n % 3]) * (256 << 10)] * 16
    client.put(IDENTITY, toks, pays)
    client.load(IDENTITY, toks)
    print("go" if n == 0 else n, flush=True)  # one line per round: the test sees it busy
    n += 1
"""


def _memfd_mappings(pid: int) -> int:
    text = Path(f"/proc/{pid}/maps").read_text()
    return sum("memfd:prefixd" in line for line in text.splitlines())


def test_a_client_killed_mid_transfer_leaves_the_daemon_healthy(daemon: Daemon) -> None:
    with Client(daemon.socket, region_bytes=1 << 20) as observer:
        baseline = _memfd_mappings(daemon.pid)
        for attempt in range(2):
            hammer = subprocess.Popen(
                [sys.executable, "-c", HAMMER, str(daemon.socket)],
                stdout=subprocess.PIPE,
                cwd=REPO,
            )
            try:
                assert hammer.stdout is not None
                assert hammer.stdout.readline().strip() == b"go"
                for _ in range(1 + attempt):  # killed a round or two later, mid-transfer
                    assert hammer.stdout.readline().strip().isdigit()
                assert observer.stats()["server"]["open_connections"] == 2
            finally:
                hammer.send_signal(signal.SIGKILL)
                hammer.wait()
            assert observer.health()["status"] == "ok"
            wait_for(
                lambda: observer.stats()["server"]["open_connections"] == 1,
                "the dead client's connection closed",
            )
            # Its regions are unmapped once nothing uses them any more.
            wait_for(
                lambda: _memfd_mappings(daemon.pid) == baseline,
                "the dead client's regions unmapped",
            )
        p = tokens(80, 3 * BT)
        observer.put(IDENTITY, p, block_payloads(80, 3))
        assert _views(observer.load(IDENTITY, p)) == block_payloads(80, 3)
        stats = observer.stats()["server"]
        assert stats["connections"] == 3
        assert stats.get("errors.internal", 0) == 0
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


# --- stats, health and the CLI -------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixd", *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")},
        check=False,
    )


def test_stats_health_and_cli(daemon: Daemon) -> None:
    a = tokens(90, 5 * BT)
    pays = block_payloads(90, 5)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        hello = client.server
        assert set(hello["ops"]) >= {"hello", "attach", "put", "lookup", "load", "stats", "health"}
        assert hello["server"].startswith("prefixd/")
        assert hello["max_frame_bytes"] == 16 << 20 and hello["max_inflight"] == 64
        client.put(IDENTITY, a, pays)
        client.lookup(IDENTITY, [a, tokens(91, 8)])
        client.load(IDENTITY, a)
        health = client.health()
        assert health["status"] == "ok" and health["connections"] == 1
        assert 0 <= health["uptime_s"] < 60
        stats = client.stats()
        store, server = stats["store"], stats["server"]
        assert store["blocks"] == 5 and store["identities"] == 1
        assert store["payload_bytes"] == sum(map(len, pays))
        assert store["lookups"] == 3  # two prompts looked up, one load
        assert store["hit_blocks"] == 10 and store["loaded_blocks"] == 5
        assert store["loaded_bytes"] == sum(map(len, pays))
        assert store["map_size"] == 256 << 20
        assert server["requests.put"] == 1 and server["requests.lookup"] == 1
        assert server["requests.load"] == 1 and server["requests.attach"] == 2
        assert server["open_connections"] == 1 and server["connections"] == 1

        cli_stats = _cli("stats", "--json", "--socket", str(daemon.socket))
        assert cli_stats.returncode == 0, cli_stats.stderr
        printed = json.loads(cli_stats.stdout)
        assert printed["store"]["blocks"] == 5
        assert printed["server"]["requests.put"] == 1
        assert printed["server"]["open_connections"] == 2  # the CLI's own connection
        cli_health = _cli("health", "--json", "--socket", str(daemon.socket))
        assert cli_health.returncode == 0, cli_health.stderr
        printed = json.loads(cli_health.stdout)
        assert printed["status"] == "ok" and printed["connections"] == 2

    missing = _cli("health", "--socket", str(daemon.sockdir / "nothing.sock"), "--timeout", "2")
    assert missing.returncode != 0 and "cannot connect" in missing.stderr

    assert daemon.stop() == 0
    verify = _cli("verify", "--json", "--data-dir", str(daemon.data_dir))
    assert verify.returncode == 0, verify.stderr
    report = json.loads(verify.stdout)
    assert report["blocks"] == 5 and report["problems"] == []
    not_a_store = _cli("verify", "--data-dir", str(daemon.workdir / "no-store"))
    assert not_a_store.returncode != 0 and "no store" in not_a_store.stderr


def test_stats_and_health_while_busy(daemon_factory: DaemonFactory) -> None:
    """health answers from its own connection while another one keeps the workers busy."""
    daemon = daemon_factory("--workers", "1")
    p = tokens(95, 64 * BT)
    pays = block_payloads(95, 64, size=64 << 10)
    with Client(daemon.socket, region_bytes=8 << 20) as busy, Client(daemon.socket) as probe:
        busy.put(IDENTITY, p, pays)
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                assert busy.load(IDENTITY, p).n_blocks == 64

        thread = threading.Thread(target=hammer)
        thread.start()
        try:
            for _ in range(5):
                assert probe.health()["status"] == "ok"
                assert probe.stats()["store"]["blocks"] == 64
        finally:
            stop.set()
            thread.join(DEADLINE_S)


# --- engine-keyed blocks through the daemon ------------------------------------------------------


def test_engine_keyed_blocks_through_the_daemon(daemon: Daemon) -> None:
    import dataclasses

    from prefixd.schema.keys import pack_keys

    engine = dataclasses.replace(IDENTITY, key_bytes=36, block_tokens=32)
    keys = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(1, 7)]
    pays = block_payloads(5, 6)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert client.put(engine, pack_keys(engine, keys), pays).stored == 6
        sizes = tuple(len(p) for p in pays)
        found = client.lookup(
            engine,
            [pack_keys(engine, keys), pack_keys(engine, keys[:2] + [bytes(36)] + keys[3:])],
        )
        assert found == [Lookup(6, 6 * 32, sizes), Lookup(2, 64, sizes[:2])]
        assert _views(client.load(engine, pack_keys(engine, keys))) == pays
        # the same keys under the token-keyed identity (or another key width) are not found
        token_keyed = dataclasses.replace(engine, key_bytes=None)
        assert client.lookup(token_keyed, [pack_keys(engine, keys)]) == [Lookup(0, 0, ())]
    daemon.restart()
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert _views(client.load(engine, pack_keys(engine, keys))) == pays
