"""The vLLM direct spec's copies (prefixd.integrations.vllm.copies) on each device, without vLLM:
chunk payloads held in a region into scattered KV cache blocks, and blocks gathered back into a
region, byte for byte against a copy made in numpy. The CUDA case is the spec's device path (the
region registered, the run's one host-to-device copy on the spec's stream, the scatter on the
device); bench/gpu/run.sh runs it on a GPU machine, where vLLM's CUDA build is not at hand."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prefixd.integrations.vllm.copies import DeviceCopies, HeldPayload, Layout
from prefixd.integrations.vllm.staging import RegionRef
from prefixd.wire.region import SharedRegion

PER = 4  # blocks per chunk
PAGES = (256, 384)  # each layer's page bytes; a KV cache block row is longer (ROW)
ROW = 512
NUM_BLOCKS = 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device(name)


def _layout() -> Layout:
    refs = [SimpleNamespace(page_size_bytes=size, tensor_idx=i) for i, size in enumerate(PAGES)]
    return Layout.of(refs, PER)


def _kv(device: torch.device, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 256, (NUM_BLOCKS, ROW), dtype=np.uint8) for _ in PAGES]
    return [torch.from_numpy(r).to(device) for r in rows]


def _page(payload: np.ndarray, layer: int, page: int) -> np.ndarray:
    """Page `page` of layer `layer` in a chunk's payload: the layers in order, each PER pages."""
    start = sum(PAGES[:layer]) * PER + page * PAGES[layer]
    return payload[start : start + PAGES[layer]]


def _region_ref(region: SharedRegion) -> RegionRef:
    return RegionRef(os.getpid(), region.fd, os.fstat(region.fd).st_ino, region.size)


def _settled(copies: DeviceCopies) -> None:
    event = copies.record()
    if event is not None:
        event.synchronize()


@pytest.mark.parametrize("device_name", DEVICES)
def test_held_payloads_land_in_their_blocks_and_nowhere_else(device_name: str) -> None:
    device, layout = _device(device_name), _layout()
    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, layout.nbytes, dtype=np.uint8) for _ in range(4)]
    warnings: list[str] = []
    with SharedRegion(8 * layout.nbytes) as first, SharedRegion(3 * layout.nbytes) as second:
        # chunks 0 and 1 back to back in the first region (one run, one copy), chunk 2 in the
        # second (the scheduler's region after a reconnect), chunk 3 in the first again (held
        # there since before it): each region mapped in turn, the copies from the one before
        # it done first
        places = [
            (first, 0),
            (first, layout.nbytes),
            (second, 2 * layout.nbytes),
            (first, 5 * layout.nbytes),
        ]
        held: list[HeldPayload] = []
        for (region, offset), payload in zip(places, payloads, strict=True):
            np.frombuffer(region.view, dtype=np.uint8)[offset : offset + layout.nbytes] = payload
            held.append((_region_ref(region), offset, layout.nbytes))
        kv = _kv(device, seed=2)
        before = [t.cpu().numpy().copy() for t in kv]
        copies = DeviceCopies(list(kv), warnings.append)
        # the load starts at page 1 of its first chunk: pages 1-3 of chunk 0, 0-3 of 1 and 2,
        # 0-1 of 3
        block_ids = np.array([7, 3, 9, 1, 5, 2, 8, 11, 0, 14, 6, 10, 4])
        with copies.queued():
            nbytes = copies.install(layout, block_ids, 1, held)
        _settled(copies)
        after = [t.cpu().numpy() for t in kv]
        copies.close()
    assert nbytes == len(block_ids) * sum(PAGES)
    assert warnings == []  # on CUDA: each region was registered
    for layer, size in enumerate(PAGES):
        expected = before[layer].copy()
        for i, block in enumerate(block_ids):
            chunk, page = divmod(1 + i, PER)
            expected[block, :size] = _page(payloads[chunk], layer, page)
        np.testing.assert_array_equal(after[layer], expected)


@pytest.mark.parametrize("device_name", DEVICES)
def test_blocks_are_gathered_into_chunk_payloads(device_name: str) -> None:
    device, layout = _device(device_name), _layout()
    kv = _kv(device, seed=3)
    rows = [t.cpu().numpy().copy() for t in kv]
    copies = DeviceCopies(list(kv), lambda message: pytest.fail(message))
    blocks = np.array([[4, 0, 13, 6], [2, 15, 9, 1]])  # two chunks, PER blocks each
    with SharedRegion(4 * layout.nbytes) as region:
        view = region.view[layout.nbytes :]  # a lease that does not start at the region's start
        with copies.queued():
            keep = copies.gather(view, blocks, layout)
        _settled(copies)
        gathered = np.frombuffer(view, dtype=np.uint8)[: 2 * layout.nbytes].copy()
        del keep, view
    copies.close()
    for chunk, chunk_blocks in enumerate(blocks):
        payload = gathered[chunk * layout.nbytes : (chunk + 1) * layout.nbytes]
        for layer, size in enumerate(PAGES):
            for page, block in enumerate(chunk_blocks):
                np.testing.assert_array_equal(
                    _page(payload, layer, page), rows[layer][block, :size]
                )


def test_a_payload_of_another_size_or_region_is_refused() -> None:
    layout = _layout()
    copies = DeviceCopies(_kv(torch.device("cpu"), seed=4), lambda message: None)
    with SharedRegion(2 * layout.nbytes) as region, SharedRegion(4096) as other:
        ref = _region_ref(region)
        with pytest.raises(RuntimeError, match="bytes, this layout's"):
            copies.install(layout, np.array([0]), 0, [(ref, 0, layout.nbytes - 1)])
        # the descriptor named now holds another memfd than the inode says
        stale = RegionRef(ref.pid, other.fd, ref.inode, ref.size)
        with pytest.raises(RuntimeError, match="not the one named"):
            copies.install(layout, np.array([0]), 0, [(stale, 0, layout.nbytes)])
    copies.close()
