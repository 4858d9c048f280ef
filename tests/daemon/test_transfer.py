"""Streaming between the daemon and tensors (prefixd.client.tensors): the CPU path runs
everywhere; the CUDA tests run where a GPU is."""

from __future__ import annotations

import signal

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prefixd.client import Client
from prefixd.client.tensors import _batches
from prefixd.errors import DestinationError, TransferError
from prefixd.schema.state import StateGroup

from ..store.test_faults import corrupt_payload
from .conftest import IDENTITY, Daemon, DaemonFactory, make_identity, payload

BT = IDENTITY.block_tokens
SIZE = 3000  # a slot of a 16 KiB region cut in 3 holds one block: every block is its own batch


def tokens(n_blocks: int, seed: int = 1) -> np.ndarray:
    return (np.arange(n_blocks * BT, dtype=np.uint32) * 3 + seed * 1_000_003 + 9_000_000).astype(
        np.uint32
    )


def payloads(n: int, seed: int = 1) -> list[bytes]:
    return [payload(seed, i, SIZE) for i in range(n)]


def put_all(daemon: Daemon, prompt: np.ndarray, data: list[bytes]) -> None:
    """Store through a client with room for every payload (the streaming clients have little)."""
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert client.put(IDENTITY, prompt, data).stored == len(data)


def destinations(n: int, size: int = SIZE, device: str = "cpu") -> list[torch.Tensor]:
    """float32 tensors of `size` bytes, filled with a marker a load must overwrite."""
    return [torch.full((size // 4,), -7.0, device=device) for _ in range(n)]


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def untouched(tensor: torch.Tensor) -> bool:
    return bool((tensor == -7.0).all())


def test_batches_fill_slots_in_order() -> None:
    assert _batches([4, 4, 4, 1, 8], 8) == [(0, 2), (2, 4), (4, 5)]
    assert _batches([], 8) == []
    with pytest.raises(DestinationError, match="staging slot holds 8"):
        _batches([4, 9], 8)


def test_load_into_streams_through_every_slot(daemon: Daemon) -> None:
    prompt, data = tokens(20), payloads(20)
    put_all(daemon, prompt, data)
    with Client(daemon.socket, region_bytes=16 << 10) as client:
        dests = destinations(20)
        installed = client.load_into(IDENTITY, prompt, dests, slots=3)
        assert (installed.n_blocks, installed.n_tokens, installed.n_bytes) == (
            20,
            20 * BT,
            20 * SIZE,
        )
        assert installed.complete and installed.event is None  # CPU: done when it returns
        assert [as_bytes(d) for d in dests] == data
        # a longer list of destinations than the store holds: the hit is shorter, the rest waits
        more = destinations(24)
        longer = np.concatenate([prompt, tokens(4, seed=2)])
        installed = client.load_into(IDENTITY, longer, more, slots=2)
        assert (installed.n_blocks, installed.complete) == (20, False)
        assert all(untouched(d) for d in more[20:])
        # fewer destinations than blocks: only those
        assert client.load_into(IDENTITY, prompt, destinations(5)).n_blocks == 5


def test_a_block_that_fails_verification_is_never_installed(daemon: Daemon) -> None:
    prompt, data = tokens(8, seed=3), payloads(8, seed=3)
    put_all(daemon, prompt, data)
    daemon.restart()  # the data is on disk, where the test damages it
    corrupt_payload(daemon.data_dir, data[5])
    with Client(daemon.socket, region_bytes=16 << 10) as client:
        dests = destinations(8)
        installed = client.load_into(IDENTITY, prompt, dests)
        assert (installed.n_blocks, installed.complete) == (5, False)
        assert [as_bytes(d) for d in dests[:5]] == data[:5]
        assert all(untouched(d) for d in dests[5:])


def test_a_daemon_killed_mid_load_reports_what_was_installed(daemon: Daemon) -> None:
    prompt, data = tokens(12, seed=4), payloads(12, seed=4)
    put_all(daemon, prompt, data)
    daemon.restart()
    with Client(daemon.socket, region_bytes=16 << 10, timeout=5) as client:
        core = client._core
        real_load = core.load_span
        calls = 0

        def load_then_die(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 4:
                daemon.stop(signal.SIGKILL)
            return real_load(*args, **kwargs)

        core.load_span = load_then_die  # type: ignore[method-assign]
        dests = destinations(12)
        with pytest.raises(TransferError) as info:
            client.load_into(IDENTITY, prompt, dests, slots=3)
        assert info.value.installed_tokens == 3 * BT
        assert [as_bytes(d) for d in dests[:3]] == data[:3]
        assert all(untouched(d) for d in dests[3:])
    daemon.start()
    with Client(daemon.socket, region_bytes=16 << 10) as client:
        installed = client.load_into(IDENTITY, prompt, dests)  # the retry, over what is there
        assert installed.complete and [as_bytes(d) for d in dests] == data


def test_store_from_publishes_in_the_background(daemon: Daemon) -> None:
    prompt = tokens(6, seed=5)
    sources = [torch.arange(i, i + SIZE // 4, dtype=torch.float32) for i in range(6)]
    with Client(daemon.socket, region_bytes=16 << 10) as client:
        future = client.store_from(IDENTITY, prompt, sources, region_bytes=1 << 20)
        stored = future.result(timeout=30)
        assert (stored.stored, stored.existed) == (6, 0)
        dests = destinations(6)
        client.load_into(IDENTITY, prompt, dests)
        assert all(torch.equal(d, s) for d, s in zip(dests, sources, strict=True))
        # later blocks of the same prompt, after the first ones
        longer = np.concatenate([prompt, tokens(2, seed=6)])
        more = [torch.ones(SIZE // 4), torch.zeros(SIZE // 4)]
        assert client.store_from(IDENTITY, longer, more, first_block=6).result(30).stored == 2
        # a later store larger than the first publisher's region gets a larger one
        big = [torch.ones(300_000) for _ in range(4)]  # 4.8 MB
        other = tokens(4, seed=12)
        assert client.store_from(IDENTITY, other, big, region_bytes=8 << 20).result(30).stored == 4


def test_warm_up_brings_back_the_most_valuable_prefixes(daemon: Daemon) -> None:
    prompts = [tokens(4, seed=10 + i) for i in range(4)]
    with Client(daemon.socket, region_bytes=64 << 10) as client:
        for i, prompt in enumerate(prompts):
            client.put(IDENTITY, prompt, payloads(4, seed=10 + i))
        for _ in range(20):  # prompts 1 and 3 are read often
            client.lookup(IDENTITY, [prompts[1], prompts[3]])
    daemon.restart()
    with Client(daemon.socket, region_bytes=64 << 10) as client:
        seen = []

        def allocate(prefix):
            seen.append(prefix.tokens.tobytes())
            return destinations(len(prefix.sizes))

        warmed = client.warm_up(8 * SIZE, allocate, tenant=IDENTITY.tenant)
        assert (warmed.prefixes, warmed.blocks, warmed.bytes) == (2, 8, 8 * SIZE)
        assert sorted(seen) == sorted(p.tobytes() for p in (prompts[1], prompts[3]))
        assert client.hot(1 << 20, tenant="someone-else") == []  # never another tenant's prompts
        server = client.stats()["server"]
        assert (server["warmed_blocks"], server["warmed_bytes"]) == (8, 8 * SIZE)


def test_load_state_into_fills_each_group(daemon: Daemon) -> None:
    hybrid = make_identity(state=(StateGroup.paged("kv"), StateGroup.checkpoint("ssm")))
    prompt = tokens(3, seed=7)
    pages = [payload(7, i, 400) for i in range(3)]
    with Client(daemon.socket, region_bytes=16 << 10) as client:
        client.put_state(
            hybrid, prompt, paged={"kv": pages}, checkpoints={"ssm": {3 * BT: b"s" * 64}}
        )
        dests = {"kv": destinations(3, 400), "ssm": destinations(1, 64)}
        installed = client.load_state_into(hybrid, prompt, dests)
        assert installed.reusable_tokens == 3 * BT
        assert [as_bytes(d) for d in dests["kv"]] == pages
        assert as_bytes(dests["ssm"][0]) == b"s" * 64
        with pytest.raises(DestinationError, match="'kv'"):
            client.load_state_into(
                hybrid, prompt, {"kv": destinations(2, 400), "ssm": dests["ssm"]}
            )


def test_a_destination_of_another_size_than_its_block_is_refused(daemon: Daemon) -> None:
    """A destination longer than its block would keep a tail no payload wrote, and pass for a
    whole block; one on the `meta` device would be written nowhere. Both are refused, untouched."""
    prompt, data = tokens(3, seed=5), payloads(3, seed=5)
    put_all(daemon, prompt, data)
    hybrid = make_identity(state=(StateGroup.paged("kv"), StateGroup.checkpoint("ssm")))
    with Client(daemon.socket, region_bytes=16 << 10) as client:
        longer = destinations(3, SIZE + 1000)
        with pytest.raises(DestinationError, match="holds 4000 bytes, the block 3000"):
            client.load_into(IDENTITY, prompt, longer)
        assert all(untouched(d) for d in longer)
        nowhere = [torch.empty(SIZE, dtype=torch.uint8, device="meta") for _ in range(3)]
        with pytest.raises(DestinationError, match="meta"):
            client.load_into(IDENTITY, prompt, nowhere)
        client.put_state(
            hybrid, prompt, paged={"kv": payloads(3)[:3]}, checkpoints={"ssm": {3 * BT: b"s" * 64}}
        )
        dests = {"kv": destinations(3), "ssm": destinations(1, 400)}
        with pytest.raises(DestinationError, match="'ssm'"):
            client.load_state_into(hybrid, prompt, dests)
        assert untouched(dests["ssm"][0])


def test_a_block_stored_again_at_another_size_since_the_lookup_ends_the_hit(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between load_into's lookup and its load another writer replaced the prefix with smaller
    payloads: they would fill each destination only in part. The hit ends there, untouched."""
    prompt = tokens(3, seed=6)
    put_all(daemon, prompt, payloads(3, seed=6))
    with (
        Client(daemon.socket, region_bytes=16 << 10) as client,
        Client(daemon.socket, region_bytes=1 << 20) as other,
    ):
        load_span = client._core.load_span
        replaced: list[bool] = []

        def after_another_writer(*args: object, **kwargs: object) -> object:
            if not replaced:
                replaced.append(True)
                assert other.delete(IDENTITY, [prompt[:BT]]) == 3  # the block and all below
                smaller = [payload(9, i, 2000) for i in range(3)]
                assert other.put(IDENTITY, prompt, smaller).stored == 3
            return load_span(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(client._core, "load_span", after_another_writer)
        dests = destinations(3)
        installed = client.load_into(IDENTITY, prompt, dests)
        assert (installed.n_blocks, installed.n_bytes, installed.complete) == (0, 0, False)
        assert all(untouched(d) for d in dests)


def test_load_into_in_batches_loads_a_hit_past_the_minimum(daemon_factory: DaemonFactory) -> None:
    """With --min-reusable-tokens, the lookup judged the whole hit: load_into's first batch,
    shorter than the minimum when slots hold one block each, is not judged again on its own."""
    daemon = daemon_factory("--min-reusable-tokens", str(2 * BT))
    prompt, data = tokens(4, seed=8), payloads(4, seed=8)
    put_all(daemon, prompt, data)
    with Client(daemon.socket, region_bytes=16 << 10) as client:  # a block per slot
        dests = destinations(4)
        installed = client.load_into(IDENTITY, prompt, dests)
        assert (installed.n_blocks, installed.complete) == (4, True)
        assert [as_bytes(d) for d in dests] == data
        assert client.load(IDENTITY, prompt[:BT]).n_blocks == 0  # a whole hit too short: none


# --- CUDA -----------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
def test_load_into_gpu_memory_returns_an_event(daemon: Daemon) -> None:
    prompt, data = tokens(16, seed=8), payloads(16, seed=8)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, prompt, data)
        dests = destinations(16, device="cuda")
        installed = client.load_into(IDENTITY, prompt, dests, wait=False)
        assert installed.event is not None
        torch.cuda.current_stream().wait_event(installed.event)
        assert [as_bytes(d) for d in dests] == data


@pytest.mark.cuda
@cuda
def test_store_from_gpu_tensors(daemon: Daemon) -> None:
    prompt = tokens(4, seed=9)
    sources = [torch.randn(SIZE // 4, device="cuda") for _ in range(4)]
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert client.store_from(IDENTITY, prompt, sources).result(30).stored == 4
        dests = destinations(4, device="cuda")
        client.load_into(IDENTITY, prompt, dests)
        assert all(torch.equal(d, s) for d, s in zip(dests, sources, strict=True))


def test_compressed_payloads_stream_decompressed(daemon_factory) -> None:
    """With compression on, the daemon decompresses batch k while batch k-1 is being copied."""
    daemon = daemon_factory("--compression", "zstd")
    prompt = tokens(9, seed=11)
    data = [(b"layer %d, head %d " % (i, i % 3)) * (SIZE // 16) for i in range(9)]
    put_all(daemon, prompt, data)
    with Client(daemon.socket, region_bytes=16 << 10) as client:
        assert client.stats()["store"]["compression_ratio"] > 2
        dests = [torch.zeros(len(d), dtype=torch.uint8) for d in data]
        assert client.load_into(IDENTITY, prompt, dests, slots=2).complete
        assert [as_bytes(d) for d in dests] == data
