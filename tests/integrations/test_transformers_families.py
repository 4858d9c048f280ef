"""Every causal-LM family of transformers 5.24: restored exactly, or refused for a stated reason.

The layout is found from what each family's cache layers are, so a family that reuses known layer
kinds needs no code of its own. `zoo.check` builds a family tiny, exports its state, restores it
into a fresh cache and continues, directly and from an earlier checkpoint with a replay. The core
run checks one family of each cache layer kind (and their hybrids) at several block and page
sizes; `--long` (or PREFIXD_LONG=1) runs the whole table and prints it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import DynamicCache

from prefixd.errors import LayoutError
from prefixd.integrations.transformers import (
    capture_checkpoint,
    export_state,
    restore_state,
    state_layout,
    state_spec,
)

from . import zoo

REPO = Path(__file__).resolve().parents[2]


def test_every_kind_is_restored_exactly() -> None:
    results = [zoo.check(family) for family in zoo.REPRESENTATIVES]
    print("\n" + "\n".join(r.row() for r in results))
    assert [r.family for r in results if r.result != "exact"] == []


@pytest.mark.parametrize("block, page", [(8, 1), (16, 3)])
@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next", "falcon_h1", "deepseek_v32"])
def test_block_and_page_sizes(family: str, block: int, page: int) -> None:
    result = zoo.check(family, block=block, page=page, prefix_blocks=6, tail=block // 2 + 1)
    print(f"\n{result.row()} block {block} page {page}")
    assert result.result == "exact", result


def test_the_docs_table_is_a_whole_run_of_this_transformers() -> None:
    """docs/families.md's table is what `python -m tests.integrations.zoo --write` writes: every
    family of the transformers installed, once and in order, each row as `Result.row` writes it,
    only allowed results, refusals with a documented reason, and the counts its summary states
    (a transformers upgrade needs a fresh run)."""
    page = (REPO / "docs" / "families.md").read_text()
    start, end = page.index(zoo.TABLE_START), page.index(zoo.TABLE_END)
    summary, blank, *table = page[start:end].splitlines()[1:]
    assert blank == "" and table[:2] == zoo.TABLE_HEAD.splitlines()
    results = [zoo.Result.of_row(row) for row in table[2:]]
    assert [r.row() for r in results] == table[2:]
    assert [r.family for r in results] == zoo.families()
    allowed = ("exact", "refused", "skipped", "as own cache")
    assert [r.family for r in results if r.result not in allowed] == []
    assert [
        r.family for r in results if r.result == "refused" and not zoo.documented(r.reason)
    ] == []
    assert {r.family for r in results if r.result == "exact"} >= set(zoo.REPRESENTATIVES)
    day = re.fullmatch(r"The table of (\d{4}-\d\d-\d\d) .*", summary)
    assert day is not None, summary
    assert summary == zoo.summary(results, day.group(1))


def test_every_family(long_run: bool) -> None:
    """The whole table: each family is exact, refused for a documented reason, or cannot be built
    small on CPU (with the reason)."""
    if not long_run:
        pytest.skip("the whole table runs under --long (PREFIXD_LONG=1): about 6 minutes here")
    results = [zoo.check(family) for family in zoo.families()]
    print("\n" + zoo.TABLE_HEAD + "\n" + "\n".join(r.row() for r in results))
    allowed = ("exact", "refused", "skipped", "as own cache")
    assert [r for r in results if r.result not in allowed] == []
    undocumented = [r for r in results if r.result == "refused" and not zoo.documented(r.reason)]
    assert undocumented == []
    stepwise = {r.family for r in results if r.reason.startswith("continued one token")}
    assert stepwise <= zoo.STEPWISE


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next", "deepseek_v32", "nemotron_h"])
def test_zeroing_any_group_moves_the_logits(family: str) -> None:
    """The control: every group that is stored matters to the continuation."""
    diffs = zoo.zeroing_diffs(family)
    print(f"\n{family}: {diffs}")
    if family == "deepseek_v32":
        # index_topk (2048 by default) is above every entry count here: the indexer selects
        # every entry whatever its keys, so they cannot matter (test_transformers_state checks
        # DeepSeek-V4's with a small top-k)
        assert diffs.pop("indexer") <= zoo.TOL
    assert diffs and all(diff > 1e-3 for diff in diffs.values()), diffs


@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1", "gemma3_text"])
def test_bf16_restores_bit_for_bit(family: str) -> None:
    """In bf16, a restored cache continues exactly like the cache it was exported from."""
    cache, state = zoo.prefill_and_export(family, 48, 8, 2, torch.bfloat16)
    ids = zoo.tokens(56)
    _, model = zoo.build(family, torch.bfloat16)
    expected = zoo.continue_logits(model, cache, ids, 48)
    restored = zoo.restore_and_continue(family, state, 48, ids, 8, 2, torch.bfloat16)
    assert restored.dtype == torch.bfloat16
    assert torch.equal(restored, expected)


def test_export_below_the_cache_length() -> None:
    """Paged state exports at any closed boundary up to the cache's length; a window only at the
    cache's end, with a refusal that says where to capture it."""
    config, model = zoo.build("llama")
    ids = zoo.tokens(64)
    cache = DynamicCache(config=config)
    zoo.forward(model, ids[:, :52], 0, cache)  # past the boundary, inside a block
    state = export_state(config, cache, n_tokens=32, block_tokens=8, page_blocks=2)
    logits = zoo.restore_and_continue("llama", state, 32, ids, 8, 2)
    reference = zoo.forward(model, ids, 0, DynamicCache(config=config))
    assert (logits - reference[:, 32:]).abs().max().item() <= zoo.TOL

    config, model = zoo.build("gemma3_text")
    cache = DynamicCache(config=config)
    zoo.forward(model, ids[:, :24], 0, cache)
    early = capture_checkpoint(config, cache, 24, block_tokens=8)
    zoo.forward(model, ids[:, 24:52], 24, cache)
    with pytest.raises(LayoutError, match="sliding window exists only at the cache's end") as err:
        export_state(config, cache, n_tokens=24, block_tokens=8)
    assert "capture_checkpoint" in str(err.value) and "52" in str(err.value)
    pages = export_state(config, cache, n_tokens=24, block_tokens=8, checkpoints=False)
    assert pages.checkpoints == {} and list(pages.paged) == ["kv"]
    pages.checkpoints = {g: {24: payload} for g, payload in early.items()}
    logits = zoo.restore_and_continue("gemma3_text", pages, 24, ids, 8, 1)
    reference = zoo.forward(model, ids, 0, DynamicCache(config=config))
    assert (logits - reference[:, 24:]).abs().max().item() <= zoo.TOL


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma3_text"])
def test_one_row_of_a_batch(family: str) -> None:
    """Export one row of a batched prefill; it restores as that prompt alone."""
    config, model = zoo.build(family)
    ids = torch.cat([zoo.tokens(40, seed=1), zoo.tokens(40, seed=2)])
    cache = DynamicCache(config=config)
    zoo.forward(model, ids[:, :32], 0, cache)
    state = export_state(config, cache, n_tokens=32, block_tokens=8, row=1)
    other = export_state(config, cache, n_tokens=32, block_tokens=8, row=0)
    assert state.paged != other.paged or state.checkpoints != other.checkpoints
    logits = zoo.restore_and_continue(family, state, 32, ids[1:], 8, 1)
    reference = zoo.forward(model, ids[1:], 0, DynamicCache(config=config))
    assert (logits - reference[:, 32:]).abs().max().item() <= zoo.TOL
    with pytest.raises(LayoutError, match="no row 2"):
        export_state(config, cache, n_tokens=32, block_tokens=8, row=2)


def test_transformers_errors_are_layout_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error transformers raises while the layout is found reaches the caller as a
    LayoutError, with the original as its cause."""
    from transformers.integrations.heterogeneity.configuration_utils import (
        AmbiguousGlobalPerLayerAttributeError,
    )

    from prefixd.integrations.transformers import layout

    config = zoo.tiny_config("llama")
    config.layer_types = ["no_such_attention"] * config.num_hidden_layers
    with pytest.raises(LayoutError, match="transformers cannot") as caught:
        state_spec(config, block_tokens=8)
    assert isinstance(caught.value.__cause__, KeyError)

    def ambiguous(*args: object) -> None:
        raise AmbiguousGlobalPerLayerAttributeError("'head_dim' is a per-layer attribute")

    monkeypatch.setattr(layout, "_kv_rows", ambiguous)
    with pytest.raises(LayoutError, match="layer 0: transformers: 'head_dim'") as caught:
        state_spec(zoo.tiny_config("llama"), block_tokens=8)
    assert isinstance(caught.value.__cause__, AmbiguousGlobalPerLayerAttributeError)


def test_a_recurrent_payload_that_does_not_fit_is_refused() -> None:
    """The recurrent payload's header is checked against the layers the config has."""
    from prefixd.integrations.transformers.fields import pack_described, unpack_described

    config, _ = zoo.build("qwen3_next")
    _, state = zoo.prefill_and_export("qwen3_next", 32, 8, 1)
    payload = state.checkpoints["recurrent"][32]
    tensors = unpack_described(payload, "recurrent")

    def attempt(blob: bytes) -> None:
        restore_state(
            config,
            reusable_tokens=32,
            block_tokens=8,
            paged=state.paged,
            checkpoints={"recurrent": blob},
        )

    attempt(payload)
    full = next(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    extra = {**tensors, (full, "conv.0"): tensors[(0, "conv.0")]}
    with pytest.raises(LayoutError, match=f"layer {full}: keeps nothing in group 'recurrent'"):
        attempt(pack_described(extra))
    missing = {key: t for key, t in tensors.items() if key[0] != 0}
    with pytest.raises(LayoutError, match="layer 0: .* empty states \\[0\\]"):
        attempt(pack_described(missing))
    renamed = {(layer, name.replace("conv", "cnv")): t for (layer, name), t in tensors.items()}
    with pytest.raises(LayoutError, match="unknown"):
        attempt(pack_described(renamed))
    with pytest.raises(LayoutError, match="past its last tensor"):
        attempt(payload + b"\0")
    with pytest.raises(LayoutError, match="cut short"):
        attempt(payload[:-1])
    with pytest.raises(LayoutError, match="not a described payload"):
        attempt(b"\0" * len(payload))
    half = {k: t.half() if k[1].startswith("conv") else t for k, t in tensors.items()}
    with pytest.raises(LayoutError, match="torch.float16, the model torch.float32"):
        attempt(pack_described(half))


@pytest.mark.parametrize(
    "family, kind",
    [("mllama", 0), ("minimax", 1), ("recurrent_gemma", 2), ("dory", 3), ("rwkv", 4)],
)
def test_each_documented_refusal_is_what_its_family_gets(family: str, kind: int) -> None:
    """Each layer kind on the documented list is refused with its own message, and only those
    messages are documented: a shape the config does not give is no such reason."""
    result = zoo.check(family)
    pattern, _ = zoo.NOT_PERSISTABLE[kind]
    assert result.result == "refused" and re.search(pattern, result.reason), result
    assert not zoo.documented("layer 0 keys: the cache holds torch.float32 (16, 4, 128)")


def test_an_indexers_position_history_is_stored() -> None:
    """Qwen4-Exp keeps its indexers' 3D positions on its first indexed layer and ropes the raw
    indexer keys with them at every step: they are stored as they are (here shifted, as an
    image's positions would be), and a DSA model that keeps none gets none back."""
    config, model = zoo.build("qwen4_exp_text")
    ids = zoo.tokens(56)
    shift = torch.tensor([[0], [7], [3]])  # the three rope axes apart, as an image makes them
    positions = (torch.arange(56) + 100).expand(3, -1) + shift

    def run(cache: DynamicCache, start: int, end: int) -> torch.Tensor:
        text = (torch.arange(start, end) + 100).unsqueeze(0)
        full = torch.cat([text, positions[:, start:end]]).unsqueeze(1)  # [4, 1, tokens]
        with torch.no_grad():
            return model(input_ids=ids[:, start:end], position_ids=full, cache=cache).logits

    reference = run(DynamicCache(config=config), 0, 56)[:, 48:]
    cache = DynamicCache(config=config)
    run(cache, 0, 48)
    state = export_state(config, cache, n_tokens=48, block_tokens=8)
    layout = state_layout(config, block_tokens=8)
    fields = {f.name: f for f in layout.fields("indexer")}
    assert fields["positions"].shape == (3,) and fields["positions"].dtype == torch.int64

    def restored(pages: list[bytes]) -> DynamicCache:
        return restore_state(
            config,
            reusable_tokens=48,
            block_tokens=8,
            paged={**state.paged, "indexer": pages},
            checkpoints={g: c[48] for g, c in state.checkpoints.items()},
        )

    again = restored(state.paged["indexer"])
    first = next(
        i
        for i, layer in enumerate(again.layers)
        if getattr(layer, "indexer_position_ids", None) is not None
    )
    assert torch.equal(again.layers[first].indexer_position_ids, positions[:, None, :48])
    logits = torch.cat([run(again, 48, 55), run(again, 55, 56)], dim=1)
    assert (logits - reference).abs().max().item() <= zoo.TOL

    def with_positions(value: torch.Tensor) -> list[bytes]:
        tensors = layout.unpack_pages("indexer", state.paged["indexer"], 48, 1)
        tensors[(first, "positions")] = value
        records = layout.block_records("indexer", tensors, 0, 6)
        return [records[i : i + 1].numpy().tobytes() for i in range(6)]

    mixed = positions[:, :48].T.clone()
    mixed[5] = -1
    with pytest.raises(LayoutError, match="mixes kept and missing positions"):
        restored(with_positions(mixed))
    # stored as missing, the history is gone and the continuation is wrong (or fails)
    blank = restored(with_positions(torch.full((48, 3), -1)))
    assert blank.layers[first].indexer_position_ids is None
    with pytest.raises(IndexError):  # the model needs the history to rope its indexer keys
        run(blank, 48, 55)

    config, model = zoo.build("deepseek_v32")  # keeps no position history
    cache, state = zoo.prefill_and_export("deepseek_v32", 48, 8, 1)
    layout = state_layout(config, block_tokens=8)
    tensors = layout.unpack_pages("indexer", state.paged["indexer"], 48, 1)
    kept = [key for key in tensors if key[1] == "positions"]
    assert len(kept) == 1 and bool((tensors[kept[0]] == -1).all())
    again = restore_state(
        config, reusable_tokens=48, block_tokens=8, paged=state.paged, checkpoints={}
    )
    assert all(getattr(layer, "indexer_position_ids", None) is None for layer in again.layers)


def test_a_float32_gap_of_the_models_own_cache_is_checked_in_float64() -> None:
    """Gemma 4's own cache continues about 1e-5 from a prefill in float32 (6e-6 to 1.8e-5 from
    run to run, so either side of TOL) and exactly in float64, where the restored cache is exact
    too. Moshi's own cache stays 0.3 away even in float64."""
    gemma = zoo.check("gemma4_text")
    assert gemma.result == "exact" and gemma.diff <= zoo.TOL, gemma
    assert not gemma.reason or gemma.reason.startswith("in float64"), gemma
    block, prefix, early = 8, 6 * 8, 2 * 8
    wide = zoo._in_float64("gemma4_text", zoo.tokens(prefix + 5 + 3), block, 2, prefix, early)
    assert wide is not None
    restored, own_from_prefill, restored_from_own = wide
    assert max(restored, own_from_prefill, restored_from_own) <= 1e-12, wide
    assert zoo.check("moshi").result == "as own cache"
