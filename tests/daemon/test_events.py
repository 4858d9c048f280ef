"""KV events through a real daemon, read by a consumer written from vLLM's source
(kv_events_consumer.py): the view it rebuilds from the events alone is the store's block set
through puts, evictions, purges, retirements, a restart (AllBlocksCleared, then the inventory) and
a subscriber gap healed by replay; tenants not named publish nothing, hash-only mode carries no
token ids, and a subscriber that never reads costs dropped events, never a put."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from prefixd import Store
from prefixd.client import Client
from prefixd.config.settings import EventSettings
from prefixd.daemon.events import EventPublisher
from prefixd.schema.chain import ROOT_PARENT, chain_hashes
from prefixd.store.journal import STORED, BlockChange

from .conftest import IDENTITY, Daemon, DaemonFactory, wait_for
from .kv_events_consumer import Consumer

BT = IDENTITY.block_tokens
ALICE = dataclasses.replace(IDENTITY, tenant="alice")
ALICE_V2 = dataclasses.replace(ALICE, weights=ALICE.weights + "-v2")
BOB = dataclasses.replace(IDENTITY, tenant="bob")


def tokens(seed: int, n_blocks: int) -> np.ndarray:
    return (np.arange(n_blocks * BT, dtype=np.uint32) * 3 + seed * 100_000).astype(np.uint32)


def start(daemon_factory: DaemonFactory, sock_dir: Path, *flags: str) -> tuple[Daemon, str, str]:
    pub, replay = f"ipc://{sock_dir}/events", f"ipc://{sock_dir}/replay"
    daemon = daemon_factory(
        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay, *flags
    )  # fmt: skip
    return daemon, pub, replay


def stored_hashes(daemon: Daemon) -> set[bytes]:
    """The store's own block set (the daemon stopped), tenant alice's."""
    with Store.open(daemon.data_dir, map_size=256 << 20) as store:
        return {
            c.block
            for batch in store.inventory()
            for c in batch
            if c.identity is not None and c.identity.tenant == "alice"
        }


def test_the_events_rebuild_the_stores_blocks(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    daemon, pub, replay = start(daemon_factory, sock_dir, "--kv-events-tenants", "alice")
    consumer = Consumer(pub, replay)
    try:
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            first, second = tokens(1, 6), tokens(2, 4)
            client.put(ALICE, first, [b"a" * 256] * 6)
            client.put(ALICE, second, [b"b" * 256] * 4)
            client.put(BOB, tokens(3, 5), [b"c" * 256] * 5)  # not named: never published
            client.put(ALICE_V2, tokens(4, 3), [b"d" * 256] * 3)
            expected = {*chain_hashes(ALICE, first), *chain_hashes(ALICE, second)}
            expected |= set(chain_hashes(ALICE_V2, tokens(4, 3)))
            consumer.until(lambda view: set(view.blocks) == expected)
            stored = consumer.view.blocks[chain_hashes(ALICE, first)[1]]
            assert stored["parent_block_hash"] == chain_hashes(ALICE, first)[0]
            assert stored["token_ids"] == tokens(1, 6)[BT : 2 * BT].tolist()
            assert stored["block_size"] == BT
            assert consumer.view.blocks[chain_hashes(ALICE, first)[0]]["parent_block_hash"] is None

            client.purge(model=ALICE.model, keep={"weights": ALICE.weights})  # a retirement
            expected -= set(chain_hashes(ALICE_V2, tokens(4, 3)))
            consumer.until(lambda view: set(view.blocks) == expected)

            # a subscriber gap: it stops reading, puts go on, it heals by replay
            consumer.sub.close(linger=0)
            client.put(ALICE, tokens(5, 3), [b"e" * 256] * 3)
            expected |= set(chain_hashes(ALICE, tokens(5, 3)))
            consumer.sub = consumer.context.socket(zmq.SUB)
            consumer.sub.setsockopt(zmq.SUBSCRIBE, b"")
            consumer.sub.connect(pub)
            consumer.until(lambda view: set(view.blocks) == expected)
            client.purge(tenant="alice")
            expected = set()
            consumer.until(lambda view: set(view.blocks) == expected)
            client.put(ALICE, first, [b"a" * 256] * 6)
            expected = set(chain_hashes(ALICE, first))
            consumer.until(lambda view: set(view.blocks) == expected)
        before = consumer.view.incarnation
        daemon.restart()  # a new start: AllBlocksCleared, then the inventory
        consumer.view.last_seq = -1  # the new start's sequence begins again at 0
        consumer.until(lambda view: view.incarnation != before and set(view.blocks) == expected)
        daemon.stop()
        assert set(consumer.view.blocks) == stored_hashes(daemon) == expected
    finally:
        consumer.close()


def test_hash_only_events_carry_no_token_ids_and_a_full_queue_drops_never_waits(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    textfile = sock_dir / "metrics.prom"
    flags = ("--kv-events-tenants", "*", "--kv-events-hash-only", "--kv-events-queue", "16")
    flags += ("--metrics-textfile", str(textfile), "--metrics-interval-s", "1")
    daemon, pub, replay = start(daemon_factory, sock_dir, *flags)
    idle = zmq.Context()
    never_reads = idle.socket(zmq.SUB)
    never_reads.setsockopt(zmq.SUBSCRIBE, b"")
    never_reads.connect(pub)
    consumer = Consumer(pub, replay)
    try:
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            client.put(BOB, tokens(1, 4), [b"a" * 256] * 4)
            consumer.until(lambda view: set(view.blocks) == set(chain_hashes(BOB, tokens(1, 4))))
            assert not consumer.view.token_ids_seen
            assert all(e["token_ids"] == [] for e in consumer.view.blocks.values())
            result = client.put(BOB, tokens(2, 64), [b"b" * 256] * 64)  # 64 changes > 16
            assert result.stored == 64
            # dropped, then AllBlocksCleared and the inventory again: the view is whole
            every = set(chain_hashes(BOB, tokens(1, 4))) | set(chain_hashes(BOB, tokens(2, 64)))
            consumer.until(lambda view: set(view.blocks) == every)
            events = {k: v for k, v in client.stats()["server"].items() if k.startswith("events.")}
        assert events["events.dropped_events"] >= 64, events
        assert events["events.resyncs"] >= 1, events

        def exported() -> bool:  # and Prometheus counts them too
            text = textfile.read_text() if textfile.exists() else ""
            return any(
                line.startswith("prefixd_kv_events_dropped_events_total ")
                and float(line.split()[1]) >= 64
                for line in text.splitlines()
            )

        wait_for(exported, "the dropped events in the metrics textfile")
    finally:
        consumer.close()
        idle.destroy(linger=0)


def test_tenants_not_named_publish_nothing(daemon_factory: DaemonFactory, sock_dir: Path) -> None:
    daemon, _pub, _replay = start(daemon_factory, sock_dir)  # no --kv-events-tenants
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(ALICE, tokens(1, 4), [b"a" * 256] * 4)
        client.purge(tenant="alice")
        server = client.stats()["server"]
    told = server["events.published_events"] + server["events.queued_events"]
    assert told == 1  # AllBlocksCleared at the start, nothing else
    assert server["events.dropped_events"] == 0


def flip_in_place(data_file: Path, needle: bytes) -> None:
    """Flip one byte of the stored payload `needle` where it lies, without rewriting the file
    (the running daemon maps it)."""
    data = data_file.read_bytes()
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "the payload is not stored exactly once"
    with open(data_file, "r+b") as f:
        f.seek(at + len(needle) // 2)
        byte = f.read(1)
        f.seek(at + len(needle) // 2)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_evictions_and_quarantines_reach_the_view(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    """Puts past the capacity evict, and a payload damaged on disk is quarantined (with the
    blocks below it) by the load that meets it: the view rebuilt from the events is the store's."""
    rng = np.random.default_rng(5)
    daemon, pub, replay = start(
        daemon_factory, sock_dir, "--kv-events-tenants", "alice", "--capacity-bytes", "96KiB"
    )  # fmt: skip
    consumer = Consumer(pub, replay)
    try:
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            for seed in range(12):  # 12 x 4 x 4 KiB: past the capacity, so some are evicted
                client.put(ALICE, tokens(seed, 4), [rng.bytes(4096) for _ in range(4)])
            victim = tokens(100, 4)
            pays = [rng.bytes(4096) for _ in range(4)]
            client.put(ALICE, victim, pays)
            hashes = chain_hashes(ALICE, victim)
            consumer.until(lambda view: set(hashes) <= set(view.blocks))
            flip_in_place(daemon.data_dir / "data.mdb", pays[1])
            with client.load(ALICE, victim) as loaded:
                assert len(loaded.views) == 1  # block 1 failed its checksum: a miss from there
            consumer.until(lambda view: not set(hashes[1:]) & set(view.blocks))
            removals = client.stats()["store"]
        daemon.stop()
        assert set(consumer.view.blocks) == stored_hashes(daemon)
        assert hashes[0] in consumer.view.blocks
        assert removals["blocks"] < 30  # of 52 put: most were evicted (96 KiB hold 24 at most)
    finally:
        consumer.close()


def test_a_request_content_block_publishes_its_token_ids_alone() -> None:
    """A router reads token ids: a block's content digest is no token (its hash covers it)."""
    from prefixd import MediaItem, Prompt
    from prefixd.daemon.events import event_of
    from prefixd.schema.content import chain_words
    from prefixd.store.journal import STORED, BlockChange

    vlm = dataclasses.replace(ALICE, mm="clip@1", request_content=True)
    ids = tokens(1, 2)
    words = chain_words(vlm, Prompt(ids, (MediaItem("img", 1, 2),))).tobytes()
    first = words[: vlm.block_words * 4]
    [block] = chain_hashes(vlm, Prompt(ids[:BT], (MediaItem("img", 1, 2),)))
    event = event_of(BlockChange(STORED, block, bytes(16), first, vlm), hash_only=False)
    assert event.token_ids == ids[:BT].tolist() and event.block_hashes == [block]


def test_a_block_whose_record_a_repair_drops_leaves_the_view(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    """`verify --fix` quarantines a block whose record is damaged without knowing whose it was: no
    event can name it under its tenant, so the view is cleared and announced again."""
    daemon, pub, replay = start(daemon_factory, sock_dir, "--kv-events-tenants", "alice")
    consumer = Consumer(pub, replay)
    prompt = tokens(7, 3)
    hashes = chain_hashes(ALICE, prompt)
    try:
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            client.put(ALICE, prompt, [b"a" * 256] * 3)
            consumer.until(lambda view: set(view.blocks) == set(hashes))
            record_tokens = prompt[BT : 2 * BT].astype("<u4").tobytes()  # block 1's record
            flip_in_place(daemon.data_dir / "data.mdb", record_tokens)
            assert client.verify(fix=True)["quarantined"] == 2
            consumer.until(lambda view: set(view.blocks) == {hashes[0]})
        daemon.stop()
        assert set(consumer.view.blocks) == stored_hashes(daemon)
    finally:
        consumer.close()


@pytest.mark.damages_store
def test_an_unreadable_identity_leaves_the_rest_of_the_inventory_announced(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    """A restart announces every block; one whose identity cannot be read is left out, never
    the end of the announcement."""
    daemon, pub, replay = start(daemon_factory, sock_dir, "--kv-events-tenants", "*")
    consumer = Consumer(pub, replay)
    try:
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            client.put(ALICE, tokens(1, 3), [b"a" * 256] * 3)
            client.put(BOB, tokens(2, 200), [b"b" * 256] * 200)
        daemon.stop()
        data_file = daemon.data_dir / "data.mdb"
        data = bytearray(data_file.read_bytes())
        needle = ALICE.encode()
        at = data.find(needle)
        while at >= 0:  # every copy of alice's identity row (LMDB keeps older pages too)
            data[at] ^= 0x5A  # its format byte: no identity decodes
            at = data.find(needle, at + 1)
        data_file.write_bytes(bytes(data))
        daemon.restart()
        consumer.view.last_seq = -1
        # in hash order, alice's blocks fall among bob's: the announcement goes on past them
        alices = chain_hashes(ALICE, tokens(1, 3))
        bobs = set(chain_hashes(BOB, tokens(2, 200)))
        assert any(h > min(alices) for h in bobs)
        consumer.until(lambda view: set(view.blocks) == bobs)
    finally:
        consumer.close()


def test_a_failed_send_is_told_and_the_events_go_on(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A send that fails (a ZeroMQ error, or anything else) is counted and logged, and the
    publisher goes on: the batch a send could not take is replayed into its gap, and what an
    unexpected failure lost is healed by a resync. The consumer's view stays the blocks stored."""
    prompt = tokens(7, 6)
    hashes = chain_hashes(ALICE, prompt)
    stored: list[BlockChange] = []

    def inventory(batch: int) -> Iterator[list[BlockChange]]:
        for start in range(0, len(stored), batch):
            yield stored[start : start + batch]

    settings = EventSettings(
        endpoint=f"ipc://{sock_dir}/events",
        replay_endpoint=f"ipc://{sock_dir}/replay",
        tenants=frozenset({"*"}),
    )
    publisher = EventPublisher(settings, inventory)
    failing: list[Exception] = []  # what the publisher's next sends raise
    send = zmq.Socket.send_multipart

    def flaky(self: zmq.Socket[bytes], *args: object, **kwargs: object) -> object:
        if failing and self.getsockopt(zmq.TYPE) == zmq.PUB:
            raise failing.pop(0)
        return send(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(zmq.Socket, "send_multipart", flaky)
    caplog.set_level(logging.ERROR, logger="prefixd.daemon.events")

    def put(i: int) -> None:
        parent = hashes[i - 1] if i else ROOT_PARENT
        words = prompt[i * BT : (i + 1) * BT].astype("<u4").tobytes()
        change = BlockChange(STORED, hashes[i], parent, words, ALICE)
        stored.append(change)
        publisher.committed([change])

    def all_stored(view: object) -> bool:
        return set(view.blocks) == set(hashes[: len(stored)])  # type: ignore[attr-defined]

    publisher.start()
    consumer = Consumer(settings.endpoint, settings.replay_endpoint)
    try:
        put(0)
        consumer.until(all_stored)
        failing.append(zmq.ZMQError(zmq.EFSM))
        put(1)
        wait_for(lambda: publisher.snapshot()["failures"] == 1, "the failed send counted")
        put(2)
        consumer.until(all_stored)  # the batch not sent, replayed
        failing.append(RuntimeError("unexpected"))
        put(3)
        wait_for(lambda: publisher.snapshot()["resyncs"] == 1, "a resync")
        put(4)
        consumer.until(all_stored)  # the inventory announced again
        assert publisher.snapshot()["failures"] == 2
        logged = [r.getMessage() for r in caplog.records]
        assert any("could not be sent" in m for m in logged), logged
        assert any("resyncing" in m for m in logged), logged
    finally:
        consumer.close()
        publisher.stop()
