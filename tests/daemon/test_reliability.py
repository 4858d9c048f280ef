"""The daemon under faults and load: killed under load, a full disk, 32 concurrent clients, and
tenants that never see each other's payloads."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixd.client import Client, DaemonUnavailableError
from prefixd.errors import PrefixdError, StoreFullError
from prefixd.schema.chain import packed_hashes
from prefixd.schema.state import StateGroup

from .conftest import DEADLINE_S, IDENTITY, Daemon, DaemonFactory, make_identity, payload, wait_for

BT = IDENTITY.block_tokens


def tokens(i: int, n_blocks: int = 3) -> np.ndarray:
    return (np.arange(n_blocks * BT, dtype=np.uint32) + 300_000_000 + i * 1000).astype(np.uint32)


def rss_bytes(pid: int, field: str = "RssAnon") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


# --- the daemon killed under load -----------------------------------------------------------------


def test_the_daemon_killed_under_load_loses_no_acknowledged_put(
    daemon_factory: DaemonFactory, long_run: bool
) -> None:
    daemon = daemon_factory()
    rng = random.Random(3)
    acknowledged: list[int] = []
    next_i = 0
    kills = 100 if long_run else 10
    for _ in range(kills):
        stop = threading.Event()

        def writer(start: int, stop: threading.Event = stop) -> None:
            i = start
            try:
                with Client(daemon.socket, region_bytes=1 << 20, timeout=DEADLINE_S) as client:
                    while not stop.is_set():
                        client.put(IDENTITY, tokens(i), [payload(i, b, 2000) for b in range(3)])
                        acknowledged.append(i)  # put returned: acknowledged
                        i += 1
            except (DaemonUnavailableError, OSError, PrefixdError):
                pass  # the daemon died under it

        thread = threading.Thread(target=writer, args=(next_i,))
        before = len(acknowledged)
        thread.start()
        # Killed while it writes: once this round's first put was acknowledged, at a random point
        # of the puts that follow (the jitter is the fault's timing, not a wait for anything).
        wait_for(
            lambda t=thread, n=before: len(acknowledged) > n or not t.is_alive(),
            "a put acknowledged",
        )
        assert thread.is_alive(), "the writer stopped before the kill"
        time.sleep(rng.uniform(0.0, 0.25))
        daemon.stop(signal.SIGKILL)
        stop.set()
        thread.join(timeout=DEADLINE_S)
        daemon.start()
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            for i in {*acknowledged[-10:], *rng.sample(acknowledged, min(10, len(acknowledged)))}:
                loaded = client.load(IDENTITY, tokens(i))
                assert [bytes(v) for v in loaded.views] == [payload(i, b, 2000) for b in range(3)]
            in_flight = (acknowledged[-1] + 1) if acknowledged else next_i
            assert client.lookup(IDENTITY, [tokens(in_flight)])[0].n_blocks in (0, 3)
            report = client.verify()
            assert report["problems"] == [], report
        next_i = in_flight + 1
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        hits = client.lookup(IDENTITY, [tokens(i) for i in acknowledged])
        assert all(hit.n_blocks == 3 for hit in hits)
    print(f"\ndaemon kills survived: {kills}, acknowledged puts kept: {len(acknowledged)}")


# --- a full disk ----------------------------------------------------------------------------------


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def test_a_full_disk_refuses_puts_keeps_reads_and_recovers(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    disk = tmp_path / "small-disk"
    if not _mount_tmpfs(disk, "24m"):
        pytest.skip("needs root and tmpfs to make a small file system")
    try:
        ballast = disk / "ballast"
        ballast.write_bytes(bytes(8 << 20))  # space to give back later
        daemon = daemon_factory(data_dir=disk / "store")
        stored: list[int] = []
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            with pytest.raises(StoreFullError) as full:
                for i in range(200):
                    client.put(IDENTITY, tokens(i), [payload(i, b, 100_000) for b in range(3)])
                    stored.append(i)
            assert full.value.code == "store_full" and "full" in full.value.message
            assert stored, "nothing fit before the disk filled"
            # reads go on, nothing is damaged
            for i in stored[:: max(1, len(stored) // 5)]:
                loaded = client.load(IDENTITY, tokens(i))
                assert [bytes(v) for v in loaded.views] == [
                    payload(i, b, 100_000) for b in range(3)
                ]
            assert client.verify()["problems"] == []
            # space comes back: so do puts
            ballast.unlink()
            nxt = stored[-1] + 1
            assert client.put(IDENTITY, tokens(nxt), [payload(nxt, b, 100_000) for b in range(3)])
            assert client.lookup(IDENTITY, [tokens(nxt)])[0].n_blocks == 3
        assert daemon.stop() == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# --- load -----------------------------------------------------------------------------------------


def test_32_clients_with_mixed_requests(daemon: Daemon, long_run: bool) -> None:
    duration = 20.0 if long_run else 4.0
    shared = tokens(0, 8)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, shared, [payload(0, b, 4000) for b in range(8)])
    before = rss_bytes(daemon.pid)
    latencies: dict[str, list[float]] = {"lookup": [], "load": [], "put": []}
    errors: list[BaseException] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration

    def worker(n: int) -> None:
        rng = random.Random(n)
        mine: dict[str, list[float]] = {k: [] for k in latencies}
        try:
            with Client(daemon.socket, region_bytes=256 << 10) as client:
                i = 0
                while time.monotonic() < deadline:
                    op = rng.choice(("lookup", "lookup", "load", "put"))
                    started = time.perf_counter()
                    if op == "lookup":
                        [hit] = client.lookup(IDENTITY, [shared])
                        assert hit.n_blocks == 8
                    elif op == "load":
                        loaded = client.load(IDENTITY, shared)
                        assert bytes(loaded.views[3]) == payload(0, 3, 4000)
                    else:
                        prompt = np.concatenate([shared, tokens(10_000 + n * 100_000 + i, 1)])
                        client.put(IDENTITY, prompt, [payload(n, i, 4000)], first_block=8)
                        i += 1
                    mine[op].append(time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported below
            with lock:
                errors.append(exc)
        with lock:
            for op, values in mine.items():
                latencies[op].extend(values)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=duration + 60)
    assert errors == []
    growth = rss_bytes(daemon.pid) - before
    summary = {
        op: (len(v), np.percentile(v, 50) * 1e6, np.percentile(v, 99) * 1e6)
        for op, v in latencies.items()
    }
    print(
        "\n32 clients, "
        + ", ".join(
            f"{op}: {n} at p50 {p50:.0f} us, p99 {p99:.0f} us"
            for op, (n, p50, p99) in summary.items()
        )
        + f"; daemon private memory grew {growth / 2**20:.1f} MiB"
    )
    assert all(n > 0 for n, _, _ in summary.values())
    assert growth < 128 << 20  # bounded: buffers are per request, caches have fixed sizes


# --- isolation ------------------------------------------------------------------------------------


def test_a_tenant_never_obtains_another_tenants_payloads(daemon: Daemon) -> None:
    alice, bob = make_identity(tenant="alice"), make_identity(tenant="bob")
    hybrid_bob = make_identity(tenant="bob", state=(StateGroup.paged("kv"),))
    hybrid_alice = make_identity(tenant="alice", state=(StateGroup.paged("kv"),))
    secret = tokens(77, 4)
    bob_payloads = [b"BOB-SECRET-%d-" % b * 50 for b in range(4)]
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(bob, secret, bob_payloads)
        client.put_state(hybrid_bob, secret, paged={"kv": bob_payloads})
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        region = client.region
        assert region is not None
        attempts = Counter()

        def leaked() -> bool:
            return b"BOB-SECRET" in bytes(region.view)

        # the same tokens, bob's own chain hashes, partial prompts, later blocks, every op
        bob_hashes = packed_hashes(bob, secret)
        for prompt in (secret, secret[: 2 * BT], np.concatenate([secret, tokens(78, 1)])):
            n = len(prompt) // BT
            for hashes in (None, bob_hashes[: n * 16]) if n <= 4 else (None,):
                attempts["lookup"] += 1
                assert client.lookup(alice, [prompt], hashes=[hashes])[0].n_blocks == 0
                for first in (0, 1, 3):
                    attempts["load"] += 1
                    assert (
                        client.load(alice, prompt, hashes=hashes, first_block=first).n_blocks == 0
                    )
                attempts["lookup_state"] += 1
                assert client.lookup_state(hybrid_alice, [prompt])[0].reusable_tokens == 0
                attempts["load_state"] += 1
                assert client.load_state(hybrid_alice, prompt).parts == ()
        attempts["hot"] += 1
        assert client.hot(1 << 30, tenant="alice") == []
        with pytest.raises(PrefixdError):
            client.hot(1 << 30, tenant="share:anything")
        assert not leaked()
        print(f"\nisolation: {sum(attempts.values())} attempts, nothing of another tenant served")


@contextlib.contextmanager
def scribbling(view: np.ndarray, *, pause_s: float) -> Iterator[None]:
    """A thread of the client writing random 4 KiB runs into `view` (its own region) until the
    block ends, pausing `pause_s` after each."""
    stop = threading.Event()

    def scribble() -> None:
        rng = np.random.default_rng(0)
        while not stop.is_set():
            at = int(rng.integers(0, view.size - 4096))
            view[at : at + 4096] = rng.integers(0, 256, 4096, dtype=np.uint8)
            if pause_s:
                stop.wait(pause_s)

    writer = threading.Thread(target=scribble)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()


def test_a_client_writing_into_its_region_during_loads_never_deletes_healthy_blocks(
    daemon: Daemon,
) -> None:
    """The attack: a second tenant's client loads its own blocks while a thread of it keeps
    writing into its region. Its loads may fail; the store quarantines nothing, and another
    tenant's blocks (and its own) stay stored and verified."""
    victim, attacker = make_identity(tenant="victim"), make_identity(tenant="attacker")
    prompt = np.arange(16 * IDENTITY.block_tokens, dtype=np.uint32) + 7
    pays = [payload(3, i, 256 << 10) for i in range(16)]
    with Client(daemon.socket, region_bytes=8 << 20) as honest:
        honest.put(victim, prompt, pays)
    with Client(daemon.socket, region_bytes=8 << 20) as client:
        client.put(attacker, prompt, pays)
        with scribbling(np.frombuffer(client.region.view, dtype=np.uint8), pause_s=0.0):
            for _ in range(100):
                client.load(attacker, prompt).release()
        store = client.stats()["store"]
    assert store["quarantined"] == 0
    assert store["blocks"] == 32
    with Client(daemon.socket, region_bytes=8 << 20) as honest:
        for identity in (victim, attacker):
            with honest.load(identity, prompt) as loaded:
                assert [bytes(v) for v in loaded.views] == pays


def test_a_client_rewriting_payloads_during_puts_never_gets_a_corrupt_block_acknowledged(
    daemon: Daemon,
) -> None:
    """The attack: puts from leased region space while a thread keeps rewriting that space.
    Puts may be refused; every block the daemon acknowledged verifies at rest."""
    identity = make_identity(tenant="rewriter")
    size, n_blocks = 256 << 10, 8
    acknowledged = refused = 0
    with Client(daemon.socket, region_bytes=4 << 20) as client:
        lease = client.reserve(size * n_blocks)
        view = np.frombuffer(lease.view, dtype=np.uint8)
        view[:] = 7
        spans = [(lease.offset + i * size, size) for i in range(n_blocks)]
        # in bursts: some puts run between them and are stored
        with scribbling(view, pause_s=0.0005):
            for seed in range(100):
                prompt = np.arange(n_blocks * IDENTITY.block_tokens, dtype=np.uint32) + seed * 997
                try:
                    acknowledged += client.put_spans(identity, prompt, spans).stored
                except PrefixdError as exc:
                    assert "changed while it was being stored" in str(exc)
                    refused += 1
        lease.release()
        assert acknowledged > 0
        report = client.verify()
        assert report["problems"] == [], report["problems"][:3]
        assert client.stats()["store"]["blocks"] == acknowledged
