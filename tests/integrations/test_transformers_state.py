"""Prefix state of `transformers` caches: export, restore and continue exactly, or refuse clearly.

Each family is a tiny model built from its config with seeded random weights (float32, CPU). The
reference is one prefill of the whole sequence; a restored cache must continue it to 1e-5.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import DynamicCache

from prefixd import Identity
from prefixd.errors import LayoutError, PrefixdError
from prefixd.integrations.transformers import (
    StatePayloads,
    capture_checkpoint,
    export_state,
    restore_state,
    state_layout,
    state_spec,
)
from prefixd.integrations.transformers.fields import pack_described, unpack_described

from .models import (
    BLOCK,
    CONFIGS,
    CONTINUE,
    FAMILIES,
    PAGE,
    PREFIX,
    TOL,
    WINDOW,
    build,
    forward,
    tokens,
)


def _v4_small_topk():
    """V4 whose indexer keeps 4 of up to 22 entries: the indexer keys then matter."""
    config = CONFIGS["deepseek_v4"]()
    config.index_topk = 4
    return config


CONFIGS["deepseek_v4_topk4"] = _v4_small_topk
GROUPS = {
    "llama": [("kv", "paged")],
    "mistral": [("window", "checkpoint")],
    "gemma3_text": [("kv", "paged"), ("window", "checkpoint")],
    "qwen3_next": [("kv", "paged"), ("recurrent", "checkpoint")],
    "kimi_linear": [("mla", "paged"), ("recurrent", "checkpoint")],
    "deepseek_v3": [("mla", "paged")],
    "deepseek_v4": [
        ("compressed", "paged"),
        ("indexer", "paged"),
        ("window", "checkpoint"),
        ("compressor", "checkpoint"),
    ],
}


@functools.cache
def reference(family: str) -> torch.Tensor:
    config, model = build(family)
    return forward(model, tokens(), 0, DynamicCache(config=config))


def prefill(family: str, *chunks: int) -> DynamicCache:
    """A cache after prefilling tokens [0, sum(chunks)) in the given chunks."""
    config, model = build(family)
    cache, start = DynamicCache(config=config), 0
    for size in chunks:
        forward(model, tokens()[:, start : start + size], start, cache)
        start += size
    return cache


@functools.cache
def exported(family: str) -> StatePayloads:
    config, _ = build(family)
    cache = prefill(family, PREFIX)
    return export_state(config, cache, n_tokens=PREFIX, block_tokens=BLOCK, page_blocks=PAGE)


def readonly(payload) -> memoryview:
    """A read-only view over a copy: restore may share nothing with the exporter."""
    return memoryview(bytes(payload))


def restore(family: str, n_tokens: int, paged: dict, checkpoints: dict) -> DynamicCache:
    config, _ = build(family)
    return restore_state(
        config,
        reusable_tokens=n_tokens,
        block_tokens=BLOCK,
        page_blocks=PAGE,
        paged={g: [readonly(p) for p in pages] for g, pages in paged.items()},
        checkpoints={g: readonly(p) for g, p in checkpoints.items()},
    )


def continue_from(family: str, cache, start: int) -> torch.Tensor:
    """Logits of tokens [start, PREFIX + CONTINUE): all but the last in one chunk, then one."""
    _, model = build(family)
    end = PREFIX + CONTINUE
    chunk = forward(model, tokens()[:, start : end - 1], start, cache)
    step = forward(model, tokens()[:, end - 1 :], end - 1, cache)  # the one-token decode path
    return torch.cat([chunk, step], dim=1)


def max_diff(family: str, logits: torch.Tensor, start: int) -> float:
    return (logits - reference(family)[:, start:]).abs().max().item()


def pages_for(payloads: StatePayloads, n_tokens: int) -> dict[str, list[bytes]]:
    """The exported pages that cover [0, n_tokens)."""
    wanted = -(-(n_tokens // BLOCK) // PAGE)
    return {g: pages[:wanted] for g, pages in payloads.paged.items()}


def checkpoints_at(payloads: StatePayloads, n_tokens: int) -> dict[str, bytes]:
    return {g: by_boundary[n_tokens] for g, by_boundary in payloads.checkpoints.items()}


# --- the spec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_state_spec_maps_each_family_to_its_groups(family: str) -> None:
    config, _ = build(family)
    spec = state_spec(config, block_tokens=BLOCK, page_blocks=PAGE)
    assert [(g.name, g.kind) for g in spec] == GROUPS[family]
    assert all(g.page_blocks == PAGE for g in spec if g.kind == "paged")
    names = dict.fromkeys(("model", "weights", "tokenizer", "template", "rope", "tenant"), "x")
    identity = Identity(**names, kv_layout="f32", block_tokens=BLOCK, state=spec)
    assert identity.state == spec


def test_state_spec_policies() -> None:
    config, _ = build("qwen3_next")
    spec = state_spec(
        config, block_tokens=BLOCK, recurrent_policy="periodic", period_tokens=4 * BLOCK
    )
    assert spec[1].policy == "periodic" and spec[1].period_tokens == 4 * BLOCK
    config, _ = build("deepseek_v4")
    spec = state_spec(config, block_tokens=BLOCK, window_policy="full")
    assert {g.name: g.policy for g in spec if g.kind == "checkpoint"} == {
        "window": "full",
        "compressor": "full",
    }
    with pytest.raises(LayoutError, match="'none'"):
        state_spec(config, block_tokens=BLOCK, window_policy="none")


# --- exact continuation ------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_restore_continues_exactly(family: str, record_property) -> None:
    config, _ = build(family)
    payloads = exported(family)
    layout = state_layout(config, block_tokens=BLOCK)
    n_blocks = PREFIX // BLOCK
    for group, pages in payloads.paged.items():
        assert [len(p) for p in pages] == [PAGE * layout.block_nbytes(group)] * (n_blocks // PAGE)
    for group, by_boundary in payloads.checkpoints.items():
        assert list(by_boundary) == [PREFIX]
        described = unpack_described(by_boundary[PREFIX], group)  # names its own tensors
        assert described and all(t.numel() for t in described.values())

    cache = restore(family, PREFIX, payloads.paged, checkpoints_at(payloads, PREFIX))
    logits = continue_from(family, cache, PREFIX)
    diff = max_diff(family, logits, PREFIX)
    print(f"\nDIFF direct {family}: {diff:.3e}")
    record_property("max_abs_logit_diff_direct", diff)
    assert diff <= TOL
    # Lossless: the restored cache continues bit for bit like the cache it was exported from.
    assert torch.equal(logits, continue_from(family, prefill(family, PREFIX), PREFIX))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("boundary", [8, 24])
def test_replay_from_an_earlier_checkpoint(family: str, boundary: int, record_property) -> None:
    """Checkpoint at B' during a two-chunk prefill; restore at B', replay B'..B, continue."""
    config, _ = build(family)
    cache = prefill(family, boundary)
    checkpoints = capture_checkpoint(config, cache, boundary, block_tokens=BLOCK)
    forward(build(family)[1], tokens()[:, boundary:PREFIX], boundary, cache)  # the second chunk
    payloads = export_state(config, cache, n_tokens=PREFIX, block_tokens=BLOCK, page_blocks=PAGE)
    # Only the pages covering B' are used; the last of them covers more blocks than B' needs
    # (B' is 1 or 3 blocks, pages hold 2).
    restored = restore(family, boundary, pages_for(payloads, boundary), checkpoints)
    diff = max_diff(family, continue_from(family, restored, boundary), boundary)
    print(f"\nDIFF replay {family} B'={boundary}: {diff:.3e}")
    record_property("max_abs_logit_diff_replay", diff)
    assert diff <= TOL


def zeroed_payload(group: str, payload: bytes) -> bytes:
    """The checkpoint payload with every tensor zeroed (its header kept)."""
    tensors = unpack_described(payload, group)
    return pack_described({key: torch.zeros_like(t) for key, t in tensors.items()})


@pytest.mark.parametrize("family", FAMILIES)
def test_every_group_matters(family: str) -> None:
    """Zeroing any one group's payloads moves the logits far past the tolerance."""
    payloads = exported(family)
    checkpoints = checkpoints_at(payloads, PREFIX)
    for group in [*payloads.paged, *checkpoints]:
        if group == "indexer":
            continue  # index_topk >= every entry count: all entries are picked, see below
        paged = {
            g: [bytes(len(p)) if g == group else p for p in ps] for g, ps in payloads.paged.items()
        }
        zeroed = {g: zeroed_payload(g, p) if g == group else p for g, p in checkpoints.items()}
        cache = restore(family, PREFIX, paged, zeroed)
        diff = max_diff(family, continue_from(family, cache, PREFIX), PREFIX)
        assert diff > 100 * TOL, f"{family}: zeroing {group!r} changed the logits by {diff:.2e}"


def test_v4_indexer_keys_matter_when_top_k_selects() -> None:
    """With index_topk below the entry count, the restored cache continues like the cache it came
    from, and zeroed indexer keys do not. (The one-shot prefill is no reference here: top-k
    near-ties flip between prefills of different lengths, moving earlier positions.)"""
    family = "deepseek_v4_topk4"
    payloads = exported(family)
    checkpoints = checkpoints_at(payloads, PREFIX)
    expected = continue_from(family, prefill(family, PREFIX), PREFIX)
    restored = continue_from(family, restore(family, PREFIX, payloads.paged, checkpoints), PREFIX)
    diff = (restored - expected).abs().max().item()
    print(f"\nDIFF direct {family} (vs the exporting cache's own continuation): {diff:.3e}")
    assert diff <= TOL
    zeroed = {**payloads.paged, "indexer": [bytes(len(p)) for p in payloads.paged["indexer"]]}
    wrong = continue_from(family, restore(family, PREFIX, zeroed, checkpoints), PREFIX)
    assert (wrong - expected).abs().max().item() > 100 * TOL


def test_sliding_window_holds_exactly_its_last_tokens() -> None:
    payloads = exported("gemma3_text")
    cache = restore("gemma3_text", PREFIX, payloads.paged, checkpoints_at(payloads, PREFIX))
    sliding, full = cache.layers[0], cache.layers[1]
    assert sliding.keys.shape[-2] == WINDOW - 1 and sliding.cumulative_length == PREFIX
    assert full.keys.shape[-2] == PREFIX
    original = prefill("gemma3_text", PREFIX)
    for mine, theirs in zip(cache.layers, original.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def test_bytes_follow_the_documented_layout() -> None:
    """A page is its blocks' records; a record is each layer's keys then values for the block's
    tokens ([tokens, heads, dim]); a checkpoint is a header describing each layer's tensors, then
    those tensors without the batch."""
    cache = prefill("llama", PREFIX)
    page = exported("llama").paged["kv"][1]  # blocks 2 and 3
    record = b"".join(
        raw(tensor[0, :, block * BLOCK : (block + 1) * BLOCK].transpose(0, 1))
        for block in (2, 3)
        for layer in cache.layers
        for tensor in (layer.keys, layer.values)
    )
    assert page == record
    cache = prefill("mistral", PREFIX)
    window = checkpoints_at(exported("mistral"), PREFIX)["window"]
    expected = {
        (index, name): getattr(layer, name)[0]
        for index, layer in enumerate(cache.layers)
        for name in ("keys", "values")
    }
    assert window == pack_described(expected)
    assert window.endswith(b"".join(raw(t) for t in expected.values()))


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "deepseek_v4", "mistral"])
def test_dtype_is_per_tensor(family: str) -> None:
    """In a bf16 model the recurrent states and the V4 compressor gate stay float32."""
    config, model = build(family, torch.bfloat16)
    cache = DynamicCache(config=config)
    forward(model, tokens()[:, :32], 0, cache)
    payloads = export_state(config, cache, n_tokens=32, block_tokens=BLOCK)
    dtypes = {
        (group, name): tensor.dtype
        for group, by_boundary in payloads.checkpoints.items()
        for (_, name), tensor in unpack_described(by_boundary[32], group).items()
    }
    if family in ("qwen3_next", "kimi_linear"):
        assert dtypes[("recurrent", "recurrent.0")] == torch.float32
        assert dtypes[("recurrent", "conv.0")] == torch.bfloat16
    if family == "deepseek_v4":
        assert dtypes[("compressor", "compressor.overlap_gate")] == torch.float32
        assert dtypes[("compressor", "compressor.overlap_kv")] == torch.bfloat16
    restored = restore_state(
        config,
        reusable_tokens=32,
        block_tokens=BLOCK,
        paged=payloads.paged,
        checkpoints=checkpoints_at(payloads, 32),
        dtype=torch.bfloat16,
    )
    for mine, theirs in zip(restored.layers, cache.layers):
        for name, value in vars(theirs).items():
            if isinstance(value, torch.Tensor) and name in ("keys", "values"):
                assert torch.equal(getattr(mine, name), value), name
            if isinstance(value, dict):
                for key, tensor in value.items():
                    if isinstance(tensor, torch.Tensor) and tensor.numel():
                        assert getattr(mine, name)[key].dtype == tensor.dtype
                        assert torch.equal(getattr(mine, name)[key], tensor), (name, key)


def test_numpy_and_bytearray_payloads_are_copied() -> None:
    """Writable numpy and bytearray payloads work, and the cache shares no memory with them."""
    payloads = exported("kimi_linear")
    config, _ = build("kimi_linear")
    pages = {
        g: [np.frombuffer(bytearray(p), dtype=np.uint8) for p in ps]
        for g, ps in payloads.paged.items()
    }
    checkpoints = {g: bytearray(p) for g, p in checkpoints_at(payloads, PREFIX).items()}
    cache = restore_state(
        config,
        reusable_tokens=PREFIX,
        block_tokens=BLOCK,
        page_blocks=PAGE,
        paged=pages,
        checkpoints=checkpoints,
    )
    for array in (a for ps in pages.values() for a in ps):
        array[:] = 0
    for buffer in checkpoints.values():
        buffer[:] = bytes(len(buffer))
    assert max_diff("kimi_linear", continue_from("kimi_linear", cache, PREFIX), PREFIX) <= TOL


def test_restore_of_nothing_is_an_empty_cache() -> None:
    config, _ = build("llama")
    cache = restore_state(config, reusable_tokens=0, block_tokens=BLOCK, paged={}, checkpoints={})
    assert cache.get_seq_length() == 0


def test_export_from_a_later_first_block() -> None:
    config, _ = build("llama")
    cache = prefill("llama", PREFIX)
    full = exported("llama").paged["kv"]
    # A page hangs on its last block: first_block 3 gives the pages ending in blocks 3.., those
    # starting at 2, 4, 6 and 8.
    later = export_state(
        config, cache, n_tokens=PREFIX, block_tokens=BLOCK, page_blocks=PAGE, first_block=3
    )
    assert later.paged["kv"] == full[1:]


# --- refusals ----------------------------------------------------------------------------------


def test_refuses_a_boundary_inside_a_block() -> None:
    config, _ = build("llama")
    cache = prefill("llama", 12)
    with pytest.raises(LayoutError, match="not a multiple of block_tokens") as caught:
        export_state(config, cache, n_tokens=12, block_tokens=BLOCK)
    assert isinstance(caught.value, PrefixdError) and isinstance(caught.value, ValueError)
    with pytest.raises(LayoutError, match="not a multiple"):
        capture_checkpoint(config, cache, 12, block_tokens=BLOCK)


def test_refuses_a_recurrent_state_before_the_caches_end() -> None:
    """A linear-attention state exists only at the cache's end: one taken after 48 tokens must
    not be stored as the state at 32 (the cache's attention layers say how many it has seen)."""
    config, _ = build("qwen3_next")
    cache = prefill("qwen3_next", 48)
    with pytest.raises(LayoutError, match="only at the cache's end, which has seen 48 tokens"):
        export_state(config, cache, n_tokens=32, block_tokens=BLOCK, page_blocks=PAGE)
    with pytest.raises(LayoutError, match="only at the cache's end"):
        capture_checkpoint(config, cache, 32, block_tokens=BLOCK)
    paged = export_state(
        config, cache, n_tokens=32, block_tokens=BLOCK, page_blocks=PAGE, checkpoints=False
    )
    assert paged.paged and not paged.checkpoints  # the pages of an earlier boundary are there


def test_refuses_an_open_page() -> None:
    """Like the store, export carries closed pages only: 9 blocks leave a page of 2 open."""
    config, _ = build("llama")
    cache = prefill("llama", 9 * BLOCK)
    with pytest.raises(LayoutError, match="blocks 8..9 is not closed"):
        export_state(config, cache, n_tokens=9 * BLOCK, block_tokens=BLOCK, page_blocks=PAGE)
    export_state(config, cache, n_tokens=9 * BLOCK, block_tokens=BLOCK)  # pages of one block


def test_refuses_a_cache_that_holds_other_tokens() -> None:
    config, _ = build("gemma3_text")
    cache = prefill("gemma3_text", 16)
    with pytest.raises(LayoutError, match="16"):
        export_state(config, cache, n_tokens=8, block_tokens=BLOCK)


def test_refuses_an_open_compressed_block() -> None:
    config, _ = build("deepseek_v4")
    # HCA compresses 8 tokens at a time: a block of 4 would end inside one.
    with pytest.raises(LayoutError, match="compression rate 8"):
        state_spec(config, block_tokens=4)
    cache = prefill("deepseek_v4", 12)
    with pytest.raises(LayoutError, match="compression rate 8"):
        export_state(config, cache, n_tokens=12, block_tokens=4)
    with pytest.raises(LayoutError, match="still open"):
        capture_checkpoint(config, cache, 12)
    with pytest.raises(LayoutError, match="compression rate 4"):
        state_spec(config, block_tokens=6)


def test_refuses_payloads_of_the_wrong_size() -> None:
    config, _ = build("deepseek_v4")
    payloads = exported("deepseek_v4")
    paged, checkpoints = payloads.paged, checkpoints_at(payloads, PREFIX)

    def attempt(paged=paged, checkpoints=checkpoints, n_tokens=PREFIX):
        return restore_state(
            config,
            reusable_tokens=n_tokens,
            block_tokens=BLOCK,
            page_blocks=PAGE,
            paged=paged,
            checkpoints=checkpoints,
        )

    first = paged["compressed"][0]
    with pytest.raises(LayoutError, match="'compressed' page 0: .* bytes, expected"):
        attempt(paged={**paged, "compressed": [first[:-1], *paged["compressed"][1:]]})
    short = pages_for(payloads, BLOCK)  # one page of two blocks, one of them needed
    with pytest.raises(LayoutError, match="'compressed' page 0: .* bytes, expected"):
        attempt(paged={**short, "compressed": [first[: len(first) // 2]]}, n_tokens=BLOCK)
    with pytest.raises(LayoutError, match="'compressed' page 0: .* bytes, expected"):
        attempt(paged={**short, "compressed": [first + first]}, n_tokens=BLOCK)
    with pytest.raises(LayoutError, match="4 pages given, 5 cover"):
        attempt(paged={**paged, "indexer": paged["indexer"][:-1]})
    with pytest.raises(LayoutError, match="'window' checkpoint at 80 tokens: 1 bytes past"):
        attempt(checkpoints={**checkpoints, "window": checkpoints["window"] + b"\0"})
    # the window of 80 tokens keeps 11 of them, one at 8 tokens only 8
    with pytest.raises(LayoutError, match="'window' checkpoint at 8 tokens: layer 0: group"):
        attempt(paged=pages_for(payloads, 8), n_tokens=8)
    with pytest.raises(LayoutError, match="missing \\['compressor'\\]"):
        attempt(checkpoints={"window": checkpoints["window"]})
    with pytest.raises(LayoutError, match="unknown \\['kv'\\]"):
        attempt(paged={**paged, "kv": []})
    with pytest.raises(LayoutError, match="byte buffer, got str"):
        attempt(checkpoints={**checkpoints, "compressor": "oops"})
    with pytest.raises(LayoutError, match="not a multiple of block_tokens"):
        attempt(n_tokens=PREFIX - 1)
