"""A model's state layout: what each of its cache layers is, and the bytes of every group.

The layout is found from the classes of the model's own `DynamicCache` layers, not from its name.
Row shapes come from each layer's config attributes; export checks them against the cache, so a
config whose attributes do not size its layers is refused, never stored wrong.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from prefixd.errors import LayoutError
from prefixd.schema.state import CHECKPOINT, PAGED

from .fields import (
    GROUP_ORDER,
    KINDS,
    KV,
    MLA,
    Buffer,
    Field,
    byte_view,
    from_raw,
    raw_bytes,
    unpack_described,
)
from .layers import (
    CompressedAttention,
    FullAttention,
    Joined,
    LayerState,
    LinearStates,
    NoState,
    SlidingAttention,
)

Tensors = dict[tuple[int, str], torch.Tensor]  # by (layer, name)
_CSA = "compressed_sparse_attention"
_HCA = "heavily_compressed_attention"


class StateLayout:
    """The groups of one model and the bytes of each."""

    def __init__(self, layers: list[LayerState], block_tokens: int, dtype: torch.dtype) -> None:
        self.layers = layers
        self.block_tokens = block_tokens
        self.dtype = dtype
        present = set().union(*(state.groups() for state in layers))
        self.groups: tuple[str, ...] = tuple(g for g in GROUP_ORDER if g in present)

    @property
    def paged_groups(self) -> tuple[str, ...]:
        return tuple(g for g in self.groups if KINDS[g] == PAGED)

    @property
    def checkpoint_groups(self) -> tuple[str, ...]:
        return tuple(g for g in self.groups if KINDS[g] == CHECKPOINT)

    def fields(self, group: str) -> list[Field]:
        """A paged group's fields in record order."""
        return [f for layer in self.layers for f in layer.fields() if f.group == group]

    def block_nbytes(self, group: str) -> int:
        """Bytes of one block's record in a paged group."""
        return sum(self._rows_per_block(f) * f.row_nbytes for f in self.fields(group))

    def _rows_per_block(self, f: Field) -> int:
        return self.block_tokens // f.tokens_per_row

    # reading a cache

    def read(
        self, cache: Cache, n_tokens: int, *, row: int = 0, checkpoints: bool = True
    ) -> tuple[Tensors, dict[str, Tensors]]:
        """The tensors of batch row `row` in `cache`: the paged ones, and the checkpoint ones by
        group."""
        if len(cache.layers) > len(self.layers):
            raise LayoutError(
                f"the cache has {len(cache.layers)} layers, the config {len(self.layers)}: layers"
                " a model adds to its cache as it runs (per-loop copies of a looped model's"
                " layers, say) follow no config, so they are not stored"
            )
        if len(cache.layers) != len(self.layers):
            raise LayoutError(
                f"the cache has {len(cache.layers)} layers, the config {len(self.layers)}"
            )
        if checkpoints and any(isinstance(p, LinearStates) for p in _parts(self.layers)):
            # a recurrent state keeps no count of its tokens: an attention layer of the cache
            # says how many it has seen (a cache of recurrent layers alone cannot be checked)
            seen = _seen(self.layers, cache.layers, row)
            if seen is not None and seen != n_tokens:
                raise LayoutError(
                    f"linear-attention states exist only at the cache's end, which has seen {seen}"
                    f" tokens, not {n_tokens}: capture them with capture_checkpoint when the"
                    f" prefill reaches {n_tokens}, and export the pages with checkpoints=False"
                )
        paged: Tensors = {}
        by_group: dict[str, Tensors] = {group: {} for group in self.checkpoint_groups}
        for state, cache_layer in zip(self.layers, cache.layers):
            tensors = state.read(cache_layer, n_tokens, row, checkpoints)
            for f in state.fields():
                paged[f.key] = _checked(f, tensors.pop(f.name), n_tokens)
            for name, tensor in tensors.items():
                by_group[state.group_of(name)][(state.layer, name)] = tensor
        return paged, by_group

    def block_records(self, group: str, tensors: Tensors, first: int, end: int) -> torch.Tensor:
        """Blocks [first, end) of a paged group as a uint8 tensor [blocks, record bytes]."""
        parts = []
        for f in self.fields(group):
            per = self._rows_per_block(f)
            rows = tensors[f.key][first * per : end * per]
            parts.append(raw_bytes(rows).reshape(end - first, -1))
        return torch.cat(parts, dim=1)

    # rebuilding a cache

    def unpack_pages(
        self, group: str, pages: Iterable[Buffer], n_tokens: int, page_blocks: int
    ) -> Tensors:
        if isinstance(pages, (bytes, bytearray, memoryview, np.ndarray, str)):
            raise LayoutError(f"group {group!r}: pages must be a list of buffers, not one buffer")
        record = self.block_nbytes(group)
        n_blocks = n_tokens // self.block_tokens
        pages = list(pages)
        wanted = -(-n_blocks // page_blocks)
        if len(pages) != wanted:
            raise LayoutError(
                f"group {group!r}: {len(pages)} pages given, {wanted} cover {n_tokens} tokens"
                f" ({page_blocks} blocks of {self.block_tokens} tokens a page)"
            )
        arrays = []
        for index, page in enumerate(pages):
            data = byte_view(page, f"group {group!r} page {index}")
            if data.size != page_blocks * record:
                raise LayoutError(
                    f"group {group!r} page {index}: {data.size} bytes, expected"
                    f" {page_blocks * record} ({page_blocks} blocks of {record} bytes)"
                )
            needed = min(page_blocks, n_blocks - index * page_blocks)
            arrays.append(data[: needed * record])  # the last page may cover more than needed
        records = np.concatenate(arrays).reshape(n_blocks, record)
        out: Tensors = {}
        column = 0
        for f in self.fields(group):
            width = self._rows_per_block(f) * f.row_nbytes
            raw = np.array(records[:, column : column + width])  # fresh and aligned
            rows = n_blocks * self._rows_per_block(f)
            out[f.key] = from_raw(raw, f.dtype, (rows, *f.shape))
            column += width
        return out

    def unpack_checkpoint(self, group: str, payload: Buffer, n_tokens: int) -> Tensors:
        what = f"group {group!r} checkpoint at {n_tokens} tokens"
        tensors = unpack_described(payload, what)
        by_layer: dict[int, dict[str, torch.Tensor]] = {}
        for (layer, name), tensor in tensors.items():
            by_layer.setdefault(layer, {})[name] = tensor
        known = {state.layer for state in self.layers}
        if set(by_layer) - known:
            raise LayoutError(f"{what}: the model has no layer {min(set(by_layer) - known)}")
        try:
            for state in self.layers:
                if group in state.groups():
                    state.check(group, by_layer.get(state.layer, {}), n_tokens)
                elif state.layer in by_layer:
                    raise state.fail(f"keeps nothing in group {group!r}")
        except LayoutError as error:
            raise LayoutError(f"{what}: {error}") from None
        return tensors

    def write(
        self, cache: Cache, tensors: Tensors, n_tokens: int, device: torch.device | str
    ) -> None:
        by_layer: dict[int, dict[str, torch.Tensor]] = {}
        for (layer, name), tensor in tensors.items():
            by_layer.setdefault(layer, {})[name] = tensor.to(device)
        for state, cache_layer in zip(self.layers, cache.layers):
            state.write(cache_layer, by_layer.get(state.layer, {}), n_tokens)


def state_layout(
    config: PreTrainedConfig, *, block_tokens: int, dtype: torch.dtype = torch.float32
) -> StateLayout:
    """The byte layout of `config`'s state for blocks of `block_tokens` tokens in `dtype`;
    refuses a block size that would cut a DeepSeek-V4 compressed block (its open buffer is never
    stored)."""
    return layout_of(config, fresh_cache(config), block_tokens=block_tokens, dtype=dtype)


def layout_of(
    config: PreTrainedConfig, cache: Cache, *, block_tokens: int, dtype: torch.dtype
) -> StateLayout:
    """`state_layout`, found from `cache`, an empty cache built for `config`."""
    check_positive("block_tokens", block_tokens)
    text = config.get_text_config(decoder=True)
    if type(text) is type(config):
        # A decoder view of the same config (an encoder-decoder family's) may carry defaults
        # where the config has values: the model reads the config itself.
        text = config
    with _from_transformers("transformers cannot describe the layers"):
        layer_types, _ = get_layer_types_and_kwargs(text)
        layer_configs = list(text.per_layer_config)
    if not len(cache.layers) == len(layer_types) == len(layer_configs):
        raise LayoutError(
            f"the cache has {len(cache.layers)} layers, the config {len(layer_types)}"
        )
    # DeepSeek-V4 (the model with compressed layers) has shared-KV MQA: values are the keys.
    shared_kv = any(hasattr(layer, "compressed_kv") for layer in cache.layers)
    # A model keeps its indexers' position history, if any, on its first indexed layer.
    first_indexed = next(
        (i for i, layer in enumerate(cache.layers) if isinstance(layer, DynamicIndexedLayer)), None
    )
    layers = []
    for index, (kind, layer_config, cache_layer) in enumerate(
        zip(layer_types, layer_configs, cache.layers)
    ):
        positions = index == first_indexed
        # a config attribute transformers refuses to give, say
        with _from_transformers(f"layer {index}: transformers"):
            state = _layer_state(
                text, layer_config, index, kind, cache_layer, dtype, shared_kv, positions
            )
        layers.append(state)
    for state in layers:
        rate = state.rate if isinstance(state, CompressedAttention) else 1
        if block_tokens % rate:
            raise LayoutError(
                f"layer {state.layer}: block_tokens {block_tokens} is not a multiple of its"
                f" compression rate {rate}, so a block boundary would leave a compressed block"
                " open"
            )
    return StateLayout(layers, block_tokens, dtype)


def _layer_state(
    text: PreTrainedConfig,
    layer: PreTrainedConfig,
    index: int,
    kind: str,
    cache_layer: object,
    dtype: torch.dtype,
    shared_kv: bool,
    positions: bool,
) -> LayerState:
    """The state of one cache layer, by what the layer is."""
    if isinstance(cache_layer, DummyLayer):
        return NoState(index)
    if index in (getattr(text, "cross_attention_layers", None) or ()):
        raise LayoutError(
            f"layer {index}: a cross-attention layer, whose keys and values come from the image"
            " encoder, not from the prompt's tokens: it is not prefix state, so it is not stored"
        )
    if isinstance(cache_layer, DynamicSlidingWindowLayer) and kind in (_CSA, _HCA):
        # DeepSeek-V4's compressed layers: a window, plus compressed entries
        window = SlidingAttention(index, cache_layer.sliding_window, dtype, shared_kv=True)
        dims = {"compressor": _attribute(layer, index, "head_dim")}
        if kind == _CSA:
            dims["indexer"] = _attribute(layer, index, "index_head_dim")
        return CompressedAttention(index, window, layer.compress_rates[kind], dims, dtype)
    parts: list[LayerState] = []
    if isinstance(cache_layer, DynamicSlidingWindowLayer):
        if type(cache_layer).update is not DynamicSlidingWindowLayer.update:
            raise _unknown(index, cache_layer, "keeps its window its own way")
        size = cache_layer.sliding_window
        parts.append(SlidingAttention(index, size, dtype, shared_kv=shared_kv))
    elif isinstance(cache_layer, DynamicLayer):
        if type(cache_layer).update is not DynamicLayer.update:
            raise _unknown(index, cache_layer, "keeps its keys its own way")
        group = MLA if getattr(layer, "kv_lora_rank", None) else KV
        indexer = 0
        indexer_types = getattr(text, "indexer_types", None) or ()
        shared = index < len(indexer_types) and indexer_types[index] == "shared"
        if isinstance(cache_layer, DynamicIndexedLayer) and not shared:
            # a layer of a "shared" indexer reuses an earlier layer's selection: no keys
            indexer = _first(layer, "index_head_dim", "indexer_head_dim")
            if not isinstance(indexer, int) or indexer <= 0:
                raise LayoutError(f"layer {index}: its config does not size its indexer keys")
        key_row, value_row = _kv_rows(layer, index)
        parts.append(
            FullAttention(index, group, key_row, value_row, dtype, indexer, positions=positions)
        )
    if isinstance(cache_layer, LinearAttentionCacheLayerMixin):
        parts.append(LinearStates(index, cache_layer.number_of_states, dtype))
    if not parts:
        raise _unknown(index, cache_layer, "is no cache layer kind prefixd knows")
    return parts[0] if len(parts) == 1 else Joined(index, parts)


def _unknown(index: int, cache_layer: object, why: str) -> LayoutError:
    return LayoutError(f"layer {index}: {type(cache_layer).__name__} {why}, so it is not stored")


def _kv_rows(layer: PreTrainedConfig, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, dim) of one token's keys and values, from the layer's config attributes."""
    rank = getattr(layer, "kv_lora_rank", None)
    if rank:  # MLA: the compressed KV as keys, the rope key as values, one "head"
        return (1, rank), (1, _attribute(layer, index, "qk_rope_head_dim"))
    decoder_heads = _first(layer, "decoder_attention_heads")
    if decoder_heads:  # the decoder of an encoder-decoder family: multi-head attention
        row = (int(decoder_heads), int(layer.d_model) // int(decoder_heads))
        return row, row
    if getattr(layer, "new_decoder_architecture", False):
        heads = _first(layer, "num_kv_heads")
    elif getattr(layer, "multi_query", False):
        heads = 1
    else:
        heads = _first(layer, "num_key_value_heads")
    attention_heads = _first(layer, "num_attention_heads")
    if heads is None:
        heads = attention_heads
    head_dim = _first(layer, "head_dim", "dim_head", "attention_head_dim")
    if head_dim is None and attention_heads:
        head_dim = layer.hidden_size // attention_heads
    value_dim = _first(layer, "v_head_dim") or head_dim
    if not heads or not head_dim or not value_dim:
        raise LayoutError(f"layer {index}: its config does not say its key/value heads and size")
    return (int(heads), int(head_dim)), (int(heads), int(value_dim))


def _first(layer: PreTrainedConfig, *names: str) -> Any:
    for name in names:
        try:
            value = getattr(layer, name, None)
        except Exception:  # noqa: BLE001 - a config may refuse a global read of a per-layer attribute
            value = None
        if value is not None:
            return value
    return None


def _attribute(layer: PreTrainedConfig, index: int, name: str) -> int:
    value = getattr(layer, name, None)
    if not isinstance(value, int) or value <= 0:
        raise LayoutError(f"layer {index}: its config has no {name}")
    return value


def fresh_cache(config: PreTrainedConfig) -> DynamicCache:
    """An empty `DynamicCache` for `config`, with its model's own cache layer classes; what
    transformers raises is a `LayoutError` caused by it, so callers catch one class."""
    with _from_transformers("transformers cannot build a cache for this config"):
        text = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text)
        if any(kind not in DYNAMIC_LAYER_TYPE_MAPPING for kind in layer_types):
            # Models register their own layer classes (DeepSeek-V4) when their module is imported.
            name = text.model_type
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        return DynamicCache(config=config)


@contextlib.contextmanager
def _from_transformers(what: str) -> Iterator[None]:
    """What transformers raises, as a LayoutError `what: error` caused by it."""
    try:
        yield
    except LayoutError:
        raise
    except Exception as error:
        raise LayoutError(f"{what}: {error}") from error


def check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")
    return value


def _checked(f: Field, tensor: torch.Tensor, n_tokens: int) -> torch.Tensor:
    shape = (n_tokens // f.tokens_per_row, *f.shape)  # a field is paged: a row per token or entry
    if tuple(tensor.shape) != shape or tensor.dtype != f.dtype:
        raise LayoutError(
            f"{f}: the cache holds {tensor.dtype} {tuple(tensor.shape)}, the layout expects"
            f" {f.dtype} {shape} (from the config's attributes)"
        )
    return tensor


def _parts(states: Iterable[LayerState]) -> Iterator[LayerState]:
    for state in states:
        yield from state.parts if isinstance(state, Joined) else (state,)


def _seen(states: list[LayerState], cache_layers: Any, row: int) -> int | None:
    """How many tokens the cache has seen, by its first attention layer that counts them."""
    for state, cache_layer in zip(states, cache_layers):
        for part in _parts((state,)):
            if isinstance(part, SlidingAttention):
                return int(cache_layer.cumulative_length)
            keys = getattr(cache_layer, "keys", None)
            if isinstance(part, FullAttention) and isinstance(keys, torch.Tensor) and keys.dim():
                return int(keys.shape[-2])
    return None
