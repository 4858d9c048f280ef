"""Many clients loading large, overlapping chains through one daemon at once: every load is split
into pieces that the daemon's copy threads interleave across requests (prefixd.store.fair); each
client still gets exactly the stored bytes, and one client scribbling in its own region while it
loads stops only its own loads short, never quarantines a block."""

from __future__ import annotations

import threading

import numpy as np

from prefixd.client import Client
from prefixd.store.codec import PIECE_BYTES

from .conftest import DEADLINE_S, IDENTITY, Daemon

BT = IDENTITY.block_tokens
BLOCK = 256 << 10
N_BLOCKS = 3 * PIECE_BYTES // BLOCK + 2  # four pieces or so per load
REGION = N_BLOCKS * BLOCK + (1 << 20)


def _chains() -> list[tuple[np.ndarray, list[bytes]]]:
    rng = np.random.default_rng(11)
    base = (np.arange(N_BLOCKS * BT, dtype=np.uint32) + 700_000_000).astype(np.uint32)
    other = base.copy()
    fork = N_BLOCKS // 2
    other[fork * BT :] += 1  # shares its first half with `base`
    first = [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(N_BLOCKS)]
    second = first[:fork] + [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
                             for _ in range(N_BLOCKS - fork)]  # fmt: skip
    return [(base, first), (other, second)]


def test_concurrent_split_loads_get_the_stored_bytes(daemon: Daemon) -> None:
    chains = _chains()
    with Client(daemon.socket, region_bytes=REGION) as writer:
        for prompt, payloads in chains:
            for first in range(0, N_BLOCKS, 4):
                end = min(first + 4, N_BLOCKS)
                writer.put(IDENTITY, prompt[: end * BT], payloads[first:end], first_block=first)
    n_loaders, rounds = 6, 5
    errors: list[BaseException] = []
    start = threading.Barrier(n_loaders + 1)
    loaders_done = threading.Event()
    scribbled = {"loads": 0, "short": 0}

    def load(index: int) -> None:
        try:
            with Client(daemon.socket, region_bytes=REGION) as client:
                start.wait(DEADLINE_S)
                for round_ in range(rounds):
                    prompt, payloads = chains[(index + round_) % 2]
                    blocks = N_BLOCKS - (index + round_) % 3  # prefixes of several lengths
                    with client.load(IDENTITY, prompt[: blocks * BT]) as loaded:
                        assert loaded.n_blocks == blocks
                        assert [bytes(v) for v in loaded.views] == payloads[:blocks]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            start.abort()

    def scribble() -> None:
        """Loads while another thread of this client writes all over its region."""
        try:
            with Client(daemon.socket, region_bytes=REGION) as client:
                assert client.region is not None
                region = np.frombuffer(client.region.view, dtype=np.uint8)
                stop = threading.Event()

                def write() -> None:
                    value = 0
                    while not stop.is_set():
                        value = (value + 1) % 251
                        region[:: 4096 // 2] = value  # a byte in every half page

                writer_thread = threading.Thread(target=write)
                start.wait(DEADLINE_S)
                writer_thread.start()
                try:
                    prompt, _payloads = chains[0]
                    while not loaders_done.is_set() or scribbled["loads"] < 3:
                        with client.load(IDENTITY, prompt) as loaded:
                            scribbled["loads"] += 1
                            scribbled["short"] += loaded.n_blocks < N_BLOCKS
                finally:
                    stop.set()
                    writer_thread.join()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=load, args=(i,)) for i in range(n_loaders)]
    scribbler = threading.Thread(target=scribble)
    for thread in [*threads, scribbler]:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
    loaders_done.set()
    scribbler.join(DEADLINE_S)
    assert not any(t.is_alive() for t in [*threads, scribbler])
    assert not errors, errors[0]
    with Client(daemon.socket, region_bytes=REGION) as observer:
        stats = observer.stats()
        for prompt, payloads in chains:  # every block is still there and intact
            with observer.load(IDENTITY, prompt) as loaded:
                assert [bytes(v) for v in loaded.views] == payloads
    assert stats["store"]["quarantined"] == 0
    assert scribbled["loads"] >= 3
