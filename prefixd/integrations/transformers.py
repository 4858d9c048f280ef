"""Save the prefix state of a `transformers` cache as prefixd state-group payloads, and restore it.

After a prefill, a `transformers` `Cache` holds one layer object per decoder layer. This module maps
that state onto the groups of `prefixd.schema.state` (see `state_spec`):

  kv          paged       full-attention keys and values, one row per token
  mla         paged       MLA latents (DeepSeek-V3, Kimi-Linear): the compressed KV and the rope key
  compressed  paged       DeepSeek-V4 CSA/HCA compressed entries, one row per closed compressed block
  indexer     paged       DeepSeek-V4 lightning-indexer keys, one row per closed CSA block
  window      checkpoint  sliding-window keys/values: exactly the last `sliding_window - 1` tokens
  compressor  checkpoint  DeepSeek-V4 CSA overlap state (the last closed window's Ca slice)
  recurrent   checkpoint  linear-attention conv and recurrent states (Gated DeltaNet, KDA)

Byte layout. Nothing is pickled: every offset follows from the config, `block_tokens` and the model
dtype, so the reader needs no header. Tensors are stored without their batch dimension (a prefix is
one sequence) in row-major order, each in its own dtype: recurrent states and the V4 compressor gate
stay float32 whatever the model dtype.

* A paged group's page is the concatenation of its `page_blocks` blocks' records. A block's record
  holds, layer by layer and tensor by tensor (keys before values), that block's rows, so the first
  blocks of a page are a byte prefix of it. Like the store, export refuses a page still open.
* A checkpoint payload holds, layer by layer and tensor by tensor, the whole tensor at the boundary.

Restoring builds the cache layers directly instead of replaying them through `update()`: a sliding
layer rebuilt through `update()` keeps the wrong keys and DeepSeek-V4 then gives wrong logits with
no error, and a linear-attention layer needs `has_previous_state` set.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from prefixd.errors import LayoutError
from prefixd.schema.state import CHECKPOINT, PAGED, StateGroup, StateSpec, check_spec

__all__ = [
    "GROUP_ORDER",
    "Field",
    "LayoutError",
    "StateLayout",
    "StatePayloads",
    "capture_checkpoint",
    "export_state",
    "restore_state",
    "state_layout",
    "state_spec",
]

KV = "kv"
MLA = "mla"
COMPRESSED = "compressed"
INDEXER = "indexer"
WINDOW = "window"
COMPRESSOR = "compressor"
RECURRENT = "recurrent"
# Groups appear in a spec in this order, so a spec is the same for equal configs.
GROUP_ORDER = (KV, MLA, COMPRESSED, INDEXER, WINDOW, COMPRESSOR, RECURRENT)
_KINDS = {
    KV: PAGED,
    MLA: PAGED,
    COMPRESSED: PAGED,
    INDEXER: PAGED,
    WINDOW: CHECKPOINT,
    COMPRESSOR: CHECKPOINT,
    RECURRENT: CHECKPOINT,
}
_CSA = "compressed_sparse_attention"
_HCA = "heavily_compressed_attention"
_F32 = torch.float32  # recurrent states and V4 gates are float32 in every model dtype

Buffer = bytes | bytearray | memoryview | np.ndarray


@dataclass(frozen=True)
class Field:
    """One tensor of one layer inside a group's payload.

    For a paged group `shape` is the shape of one row, and a row covers `tokens_per_row` tokens (the
    compression rate of a compressed entry, 1 otherwise). For a checkpoint group `shape` is the
    whole tensor at the boundary the layout was asked for.
    """

    group: str
    layer: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tokens_per_row: int = 1

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.name)

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _itemsize(self.dtype)

    def __str__(self) -> str:
        return f"layer {self.layer} {self.name}"


@dataclass
class StatePayloads:
    """What `export_state` returns: pages per paged group, and payloads per checkpoint group.

    `paged[group]` lists the pages starting in blocks [first_block, n_tokens // block_tokens);
    `checkpoints[group]` maps a boundary (in tokens) to the payload at that boundary.
    """

    paged: dict[str, list[bytes]] = field(default_factory=dict)
    checkpoints: dict[str, dict[int, bytes]] = field(default_factory=dict)


# --- per-layer state ---------------------------------------------------------------------------


class _LayerState:
    """How one cache layer's state splits into fields, and how to read and rebuild it."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def fields(self, n_tokens: int) -> list[Field]:
        raise NotImplementedError

    def read(self, cache_layer: Any, n_tokens: int) -> dict[str, torch.Tensor]:
        """The layer's tensors by field name, batch dimension dropped (paged: all rows so far)."""
        raise NotImplementedError

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        """Make the fresh `cache_layer` hold exactly the state after `n_tokens` tokens."""
        raise NotImplementedError

    def _fail(self, message: str) -> LayoutError:
        return LayoutError(f"layer {self.layer}: {message}")


class _NoState(_LayerState):
    """A layer that caches nothing (a KV-sharing consumer, an MLP-only layer)."""

    def fields(self, n_tokens: int) -> list[Field]:
        return []

    def read(self, cache_layer: Any, n_tokens: int) -> dict[str, torch.Tensor]:
        return {}

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        return None


class _FullAttention(_LayerState):
    """Keys and values of every token (`DynamicLayer`): paged, one row per token."""

    def __init__(
        self,
        layer: int,
        group: str,
        key_row: tuple[int, ...],
        value_row: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        super().__init__(layer)
        self.group, self.key_row, self.value_row, self.dtype = group, key_row, value_row, dtype

    def fields(self, n_tokens: int) -> list[Field]:
        return [
            Field(self.group, self.layer, "keys", self.key_row, self.dtype),
            Field(self.group, self.layer, "values", self.value_row, self.dtype),
        ]

    def read(self, cache_layer: Any, n_tokens: int) -> dict[str, torch.Tensor]:
        keys, values = _batch_one(self, cache_layer.keys), _batch_one(self, cache_layer.values)
        if keys.shape[-2] != n_tokens:
            raise self._fail(f"holds {keys.shape[-2]} tokens, not {n_tokens}")
        # [heads, tokens, dim] -> [tokens, heads, dim]: rows are tokens.
        return {"keys": keys.transpose(0, 1), "values": values.transpose(0, 1)}

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        keys = tensors["keys"].transpose(0, 1).unsqueeze(0).contiguous()
        values = tensors["values"].transpose(0, 1).unsqueeze(0).contiguous()
        cache_layer.lazy_initialization(keys, values)
        cache_layer.keys, cache_layer.values = keys, values


class _SlidingAttention(_LayerState):
    """A sliding window (`DynamicSlidingWindowLayer`): the last `window - 1` tokens' keys/values.

    `shared_kv` is DeepSeek-V4's shared-KV MQA, where values are the keys: they are stored once.
    """

    def __init__(
        self, layer: int, window: int, row: tuple[int, int], dtype: torch.dtype, *, shared_kv: bool
    ) -> None:
        super().__init__(layer)
        self.window, self.row, self.dtype, self.shared_kv = window, row, dtype, shared_kv

    def kept(self, n_tokens: int) -> int:
        return min(self.window - 1, n_tokens)

    def fields(self, n_tokens: int) -> list[Field]:
        heads, dim = self.row
        shape = (heads, self.kept(n_tokens), dim)
        names = ("keys",) if self.shared_kv else ("keys", "values")
        return [Field(WINDOW, self.layer, name, shape, self.dtype) for name in names]

    def read(self, cache_layer: Any, n_tokens: int) -> dict[str, torch.Tensor]:
        if cache_layer.cumulative_length != n_tokens:
            raise self._fail(f"has seen {cache_layer.cumulative_length} tokens, not {n_tokens}")
        keys = _batch_one(self, cache_layer.keys)
        if keys.shape[-2] != self.kept(n_tokens):
            raise self._fail(
                f"holds {keys.shape[-2]} window tokens, not the last {self.kept(n_tokens)}"
                " (was it rebuilt through update() or recording its past?)"
            )
        if self.shared_kv:
            return {"keys": keys}
        return {"keys": keys, "values": _batch_one(self, cache_layer.values)}

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        keys = tensors["keys"].unsqueeze(0)
        values = keys if self.shared_kv else tensors["values"].unsqueeze(0)
        cache_layer.lazy_initialization(keys, values)
        cache_layer.keys, cache_layer.values = keys, values
        cache_layer.cumulative_length = n_tokens


class _LinearAttention(_LayerState):
    """A linear-attention layer (`LinearAttentionLayer`): its conv state and recurrent state."""

    def __init__(
        self,
        layer: int,
        conv: tuple[int, int],
        recurrent: tuple[int, int, int],
        dtype: torch.dtype,
    ) -> None:
        super().__init__(layer)
        self.conv, self.recurrent, self.dtype = conv, recurrent, dtype

    def fields(self, n_tokens: int) -> list[Field]:
        return [
            Field(RECURRENT, self.layer, "conv", self.conv, self.dtype),
            Field(RECURRENT, self.layer, "recurrent", self.recurrent, _F32),
        ]

    def read(self, cache_layer: Any, n_tokens: int) -> dict[str, torch.Tensor]:
        if cache_layer.number_of_states != 1 or not cache_layer.has_previous_state[0]:
            raise self._fail("holds no single conv/recurrent state (run the prefill first)")
        if cache_layer.record_past:
            raise self._fail("records its past: crop it before capturing a checkpoint")
        return {
            "conv": _batch_one(self, cache_layer.conv_states[0]),
            "recurrent": _batch_one(self, cache_layer.recurrent_states[0]),
        }

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        conv, recurrent = tensors["conv"].unsqueeze(0), tensors["recurrent"].unsqueeze(0)
        cache_layer.lazy_initialization(
            conv_states=conv, state_idx=0, conv_kernel_size=conv.shape[-1]
        )
        cache_layer.lazy_initialization(recurrent_states=recurrent, state_idx=0)
        # Copied into the layer's own tensors, which keep their static address.
        cache_layer.conv_states[0].copy_(conv)
        cache_layer.recurrent_states[0].copy_(recurrent)
        cache_layer.has_previous_state[0] = True


class _CompressedAttention(_LayerState):
    """A DeepSeek-V4 CSA or HCA layer: a shared-KV sliding window plus compressed entries.

    Each closed block of `rate` tokens has one compressed entry (paged). A CSA layer also keeps
    lightning-indexer keys (paged) and, for both series, the last closed window's Ca slice, which
    the next window's entry overlaps (the `compressor` checkpoint). The slice's gate is float32
    because the position bias added to it is.
    """

    def __init__(
        self,
        layer: int,
        window: _SlidingAttention,
        rate: int,
        dims: dict[str, int],
        dtype: torch.dtype,
    ) -> None:
        super().__init__(layer)
        self.window, self.rate, self.dims, self.dtype = window, rate, dims, dtype
        self.overlaps = "indexer" in dims  # CSA: windows overlap their predecessor

    def fields(self, n_tokens: int) -> list[Field]:
        out = self.window.fields(n_tokens)
        for name, dim in self.dims.items():
            group = COMPRESSED if name == "compressor" else INDEXER
            out.append(Field(group, self.layer, name, (dim,), self.dtype, self.rate))
        if self.overlaps:
            for name, dim in self.dims.items():
                shape = (self.rate, dim)
                out.append(Field(COMPRESSOR, self.layer, f"{name}.overlap_kv", shape, self.dtype))
                out.append(Field(COMPRESSOR, self.layer, f"{name}.overlap_gate", shape, _F32))
        return out

    def read(self, cache_layer: Any, n_tokens: int) -> dict[str, torch.Tensor]:
        out = self.window.read(cache_layer, n_tokens)
        for name in self.dims:
            buffered = cache_layer.buffer_kv[name]
            if buffered is not None and buffered.shape[1]:
                raise self._fail(
                    f"the {name} block of {self.rate} tokens is still open ({buffered.shape[1]}"
                    f" tokens buffered): boundaries must be multiples of {self.rate} tokens"
                )
            entries = cache_layer.entry_count[name]
            if entries != n_tokens // self.rate:
                raise self._fail(f"holds {entries} {name} entries, not {n_tokens // self.rate}")
            out[name] = _batch_one(self, cache_layer.compressed_kv[name])
            if self.overlaps:
                out[f"{name}.overlap_kv"] = _batch_one(self, cache_layer.overlap_kv[name])
                out[f"{name}.overlap_gate"] = _batch_one(self, cache_layer.overlap_gate[name])
        return out

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        self.window.write(cache_layer, tensors, n_tokens)
        for name in self.dims:
            cache_layer.compressed_kv[name] = tensors[name].unsqueeze(0)
            cache_layer.entry_count[name] = n_tokens // self.rate
            cache_layer.buffer_kv[name] = cache_layer.buffer_gate[name] = None  # nothing open
            if self.overlaps:
                cache_layer.overlap_kv[name] = tensors[f"{name}.overlap_kv"].unsqueeze(0)
                cache_layer.overlap_gate[name] = tensors[f"{name}.overlap_gate"].unsqueeze(0)


# --- the model's layout ------------------------------------------------------------------------


class StateLayout:
    """The fields of every state group of one model, derived from its config alone."""

    def __init__(self, layers: list[_LayerState], block_tokens: int, dtype: torch.dtype) -> None:
        self.layers = layers
        self.block_tokens = block_tokens
        self.dtype = dtype
        present = {f.group for layer in layers for f in layer.fields(block_tokens)}
        self.groups: tuple[str, ...] = tuple(g for g in GROUP_ORDER if g in present)

    @property
    def paged_groups(self) -> tuple[str, ...]:
        return tuple(g for g in self.groups if _KINDS[g] == PAGED)

    @property
    def checkpoint_groups(self) -> tuple[str, ...]:
        return tuple(g for g in self.groups if _KINDS[g] == CHECKPOINT)

    def fields(self, group: str, n_tokens: int | None = None) -> list[Field]:
        """The group's fields in payload order; checkpoint shapes are those at `n_tokens`."""
        n = self.block_tokens if n_tokens is None else n_tokens
        return [f for layer in self.layers for f in layer.fields(n) if f.group == group]

    def block_nbytes(self, group: str) -> int:
        """Bytes of one block's record in a paged group (a page is `page_blocks` of them)."""
        return sum(self._rows_per_block(f) * f.row_nbytes for f in self.fields(group))

    def checkpoint_nbytes(self, group: str, n_tokens: int) -> int:
        return sum(f.row_nbytes for f in self.fields(group, n_tokens))

    def _rows_per_block(self, f: Field) -> int:
        return self.block_tokens // f.tokens_per_row

    # reading a cache

    def read(self, cache: Cache, n_tokens: int) -> dict[tuple[int, str], torch.Tensor]:
        """Every field's tensor in `cache`, checked against the layout."""
        if len(cache.layers) != len(self.layers):
            raise LayoutError(
                f"the cache has {len(cache.layers)} layers, the config {len(self.layers)}"
            )
        out: dict[tuple[int, str], torch.Tensor] = {}
        for state, cache_layer in zip(self.layers, cache.layers):
            tensors = state.read(cache_layer, n_tokens)
            for f in state.fields(n_tokens):
                out[f.key] = _checked(f, tensors[f.name], n_tokens)
        return out

    def block_records(
        self, group: str, tensors: Mapping[tuple[int, str], torch.Tensor], first: int, end: int
    ) -> torch.Tensor:
        """Blocks [first, end) of a paged group as a uint8 tensor [blocks, record bytes]."""
        parts = []
        for f in self.fields(group):
            per = self._rows_per_block(f)
            rows = tensors[f.key][first * per : end * per]
            parts.append(_raw_bytes(rows).reshape(end - first, -1))
        return torch.cat(parts, dim=1)

    def checkpoint_payload(
        self, group: str, tensors: Mapping[tuple[int, str], torch.Tensor], n_tokens: int
    ) -> bytes:
        parts = [_raw_bytes(tensors[f.key]) for f in self.fields(group, n_tokens)]
        return torch.cat(parts).numpy().tobytes()

    # rebuilding a cache

    def unpack_pages(
        self, group: str, pages: Iterable[Buffer], n_tokens: int, page_blocks: int
    ) -> dict[tuple[int, str], torch.Tensor]:
        """The group's tensors for the first `n_tokens` tokens from the pages covering them."""
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
            data = _byte_view(page, f"group {group!r} page {index}")
            if data.size != page_blocks * record:
                raise LayoutError(
                    f"group {group!r} page {index}: {data.size} bytes, expected"
                    f" {page_blocks * record} ({page_blocks} blocks of {record} bytes)"
                )
            needed = min(page_blocks, n_blocks - index * page_blocks)
            arrays.append(data[: needed * record])  # the last page may cover more than needed
        records = np.concatenate(arrays).reshape(n_blocks, record)
        out: dict[tuple[int, str], torch.Tensor] = {}
        column = 0
        for f in self.fields(group):
            width = self._rows_per_block(f) * f.row_nbytes
            raw = np.array(records[:, column : column + width])  # fresh and aligned
            rows = n_blocks * self._rows_per_block(f)
            out[f.key] = _from_raw(raw, f.dtype, (rows, *f.shape))
            column += width
        return out

    def unpack_checkpoint(
        self, group: str, payload: Buffer, n_tokens: int
    ) -> dict[tuple[int, str], torch.Tensor]:
        data = _byte_view(payload, f"group {group!r} checkpoint")
        expected = self.checkpoint_nbytes(group, n_tokens)
        if data.size != expected:
            raise LayoutError(
                f"group {group!r} checkpoint at {n_tokens} tokens: {data.size} bytes,"
                f" expected {expected}"
            )
        out: dict[tuple[int, str], torch.Tensor] = {}
        offset = 0
        for f in self.fields(group, n_tokens):
            # A copy per field: fresh, writable memory aligned for the field's dtype.
            raw = np.array(data[offset : offset + f.row_nbytes])
            out[f.key] = _from_raw(raw, f.dtype, f.shape)
            offset += f.row_nbytes
        return out

    def write(
        self,
        cache: Cache,
        tensors: Mapping[tuple[int, str], torch.Tensor],
        n_tokens: int,
        device: torch.device | str,
    ) -> None:
        for state, cache_layer in zip(self.layers, cache.layers):
            mine = {f.name: tensors[f.key].to(device) for f in state.fields(n_tokens)}
            state.write(cache_layer, mine, n_tokens)


def state_layout(
    config: PreTrainedConfig, *, block_tokens: int, dtype: torch.dtype = torch.float32
) -> StateLayout:
    """The byte layout of `config`'s state for blocks of `block_tokens` tokens in `dtype`.

    Refuses a block size that would cut a DeepSeek-V4 compressed block: a boundary inside one
    leaves tokens in the compressor's open buffer, which no group stores.
    """
    _check_positive("block_tokens", block_tokens)
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    layers = [
        _layer_state(text, index, kind, kwargs, dtype)
        for index, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs))
    ]
    for state in layers:
        rate = state.rate if isinstance(state, _CompressedAttention) else 1
        if block_tokens % rate:
            raise LayoutError(
                f"layer {state.layer}: block_tokens {block_tokens} is not a multiple of its"
                f" compression rate {rate}, so a block boundary would leave a compressed block"
                " open"
            )
    return StateLayout(layers, block_tokens, dtype)


def _layer_state(
    text: PreTrainedConfig, index: int, kind: str, kwargs: dict[str, Any], dtype: torch.dtype
) -> _LayerState:
    v4 = text.model_type == "deepseek_v4"
    if kind == "dummy":
        return _NoState(index)
    if kind == "full_attention":
        return _full_attention(text, index, dtype)
    if kind in ("sliding_attention", "chunked_attention"):
        row = (1, text.head_dim) if v4 else _kv_row(text)
        return _SlidingAttention(index, kwargs["sliding_window"], row, dtype, shared_kv=v4)
    if kind == "linear_attention":
        return _linear_attention(text, index, dtype)
    if v4 and kind in (_CSA, _HCA):
        window = _SlidingAttention(
            index, text.sliding_window, (1, text.head_dim), dtype, shared_kv=True
        )
        dims = {"compressor": text.head_dim}
        if kind == _CSA:
            dims["indexer"] = text.index_head_dim
        return _CompressedAttention(index, window, text.compress_rates[kind], dims, dtype)
    raise LayoutError(
        f"layer {index}: no state layout for layer type {kind!r} of model type {text.model_type!r}"
    )


def _kv_row(text: PreTrainedConfig) -> tuple[int, int]:
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return (heads, head_dim)


# Families whose MLA layers cache their latents: the compressed KV as keys, the rope key as values.
# Other MLA implementations cache other tensors, so they are refused rather than guessed.
_MLA_FAMILIES = frozenset({"deepseek_v3", "kimi_linear"})


def _full_attention(text: PreTrainedConfig, index: int, dtype: torch.dtype) -> _LayerState:
    rank = getattr(text, "kv_lora_rank", None)
    if rank and text.model_type in _MLA_FAMILIES:
        return _FullAttention(index, MLA, (1, rank), (1, text.qk_rope_head_dim), dtype)
    if rank:
        raise LayoutError(
            f"layer {index}: no MLA layout for model type {text.model_type!r}"
            f" (known: {sorted(_MLA_FAMILIES)})"
        )
    row = _kv_row(text)
    return _FullAttention(index, KV, row, row, dtype)


def _qwen3_next_shapes(text: PreTrainedConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    key_dim = text.linear_key_head_dim * text.linear_num_key_heads
    value_dim = text.linear_value_head_dim * text.linear_num_value_heads
    conv = (2 * key_dim + value_dim, text.linear_conv_kernel_dim)
    heads = text.linear_num_value_heads
    return conv, (heads, text.linear_key_head_dim, text.linear_value_head_dim)


def _kimi_linear_shapes(text: PreTrainedConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    width = text.linear_head_dim * text.linear_num_heads
    conv = (3 * width, text.linear_conv_kernel_dim)
    return conv, (text.linear_num_heads, text.linear_head_dim, text.linear_head_dim)


# The conv and recurrent state shapes of each family's linear-attention layers.
_LINEAR_SHAPES = {"qwen3_next": _qwen3_next_shapes, "kimi_linear": _kimi_linear_shapes}


def _linear_attention(text: PreTrainedConfig, index: int, dtype: torch.dtype) -> _LayerState:
    shapes = _LINEAR_SHAPES.get(text.model_type)
    if shapes is None:
        raise LayoutError(
            f"layer {index}: no linear-attention layout for model type {text.model_type!r}"
            f" (known: {sorted(_LINEAR_SHAPES)})"
        )
    conv, recurrent = shapes(text)
    return _LinearAttention(index, conv, recurrent, dtype)


# --- public API --------------------------------------------------------------------------------


def state_spec(
    config: PreTrainedConfig,
    *,
    block_tokens: int,
    page_blocks: int = 1,
    window_policy: str = "chosen",
    recurrent_policy: str | None = None,
    period_tokens: int = 0,
) -> StateSpec:
    """The identity's state groups for `config`: only the groups the model has, in GROUP_ORDER.

    `window_policy` applies to the sliding windows and the V4 compressor state, which are needed
    at the same boundaries; `recurrent_policy` (default: the same) to linear-attention states.
    Policy "none" is refused: `restore_state` rebuilds a boundary from its checkpoint only.
    """
    layout = state_layout(config, block_tokens=block_tokens)
    recurrent_policy = window_policy if recurrent_policy is None else recurrent_policy
    groups = []
    for name in layout.groups:
        if _KINDS[name] == PAGED:
            groups.append(StateGroup.paged(name, page_blocks=page_blocks))
            continue
        policy = recurrent_policy if name == RECURRENT else window_policy
        if policy == "none":
            raise LayoutError(
                f"group {name!r}: policy 'none' needs a replay from an earlier checkpoint,"
                " which restore_state does not do; use 'chosen', 'full' or 'periodic'"
            )
        period = period_tokens if policy == "periodic" else 0
        groups.append(StateGroup.checkpoint(name, policy=policy, period_tokens=period))
    spec = tuple(groups)
    check_spec(spec, block_tokens)
    return spec


def export_state(
    config: PreTrainedConfig,
    cache: Cache,
    *,
    n_tokens: int,
    block_tokens: int,
    page_blocks: int = 1,
    first_block: int = 0,
    dtype: torch.dtype | None = None,
) -> StatePayloads:
    """The payloads of `cache` after a prefill of exactly `n_tokens` tokens.

    Pages are those a store put of blocks [first_block, n_tokens // block_tokens) carries: the
    ones starting in that range. Like the store, this refuses a range that ends inside a page, as
    its last page would still be open. Checkpoints are taken at `n_tokens`, the only boundary a
    sliding window or recurrent state can still be read at (see `capture_checkpoint` for others).
    `dtype` is the model dtype, inferred from the cache when None.
    """
    _check_boundary("n_tokens", n_tokens, block_tokens)
    _check_positive("page_blocks", page_blocks)
    n_blocks = n_tokens // block_tokens
    if isinstance(first_block, bool) or not isinstance(first_block, int):
        raise LayoutError(f"first_block must be an int, got {type(first_block).__name__}")
    if not 0 <= first_block <= n_blocks:
        raise LayoutError(f"first_block {first_block} is outside 0..{n_blocks}")
    if n_blocks > first_block and n_blocks % page_blocks:
        start = n_blocks - n_blocks % page_blocks
        raise LayoutError(
            f"the page of blocks {start}..{start + page_blocks - 1} is not closed at block"
            f" {n_blocks}: export at a multiple of {page_blocks * block_tokens} tokens"
            " (only closed pages are stored)"
        )
    layout = state_layout(config, block_tokens=block_tokens, dtype=dtype or _cache_dtype(cache))
    tensors = layout.read(cache, n_tokens)
    payloads = StatePayloads()
    for group in layout.paged_groups:
        payloads.paged[group] = _pages(layout, group, tensors, first_block, n_blocks, page_blocks)
    for group in layout.checkpoint_groups:
        payloads.checkpoints[group] = {
            n_tokens: layout.checkpoint_payload(group, tensors, n_tokens)
        }
    return payloads


def capture_checkpoint(
    config: PreTrainedConfig,
    cache: Cache,
    n_tokens: int,
    *,
    block_tokens: int | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, bytes]:
    """The checkpoint payloads of `cache` now, at `n_tokens` tokens, e.g. between prefill chunks.

    A sliding window or a recurrent state can only be read at the point it was reached, so an
    engine that wants a checkpoint at an earlier boundary prefills up to it, captures, and goes
    on. `block_tokens`, when given, must divide `n_tokens`.
    """
    if block_tokens is None:
        block_tokens = _smallest_block(config)
        _check_positive("n_tokens", n_tokens)
    else:
        _check_boundary("n_tokens", n_tokens, block_tokens)
    layout = state_layout(config, block_tokens=block_tokens, dtype=dtype or _cache_dtype(cache))
    tensors = layout.read(cache, n_tokens)
    return {g: layout.checkpoint_payload(g, tensors, n_tokens) for g in layout.checkpoint_groups}


def restore_state(
    config: PreTrainedConfig,
    *,
    reusable_tokens: int,
    block_tokens: int,
    page_blocks: int = 1,
    paged: Mapping[str, Iterable[Buffer]],
    checkpoints: Mapping[str, Buffer],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DynamicCache:
    """A fresh `DynamicCache` holding exactly the state of the first `reusable_tokens` tokens.

    `paged[group]` are the pages covering [0, reusable_tokens) (only the blocks needed are read
    from the last one); `checkpoints[group]` is the payload at boundary `reusable_tokens`. Any
    contiguous byte buffer is accepted, read-only ones too: the tensors are fresh copies. Feed the
    next tokens with explicit `position_ids` starting at `reusable_tokens`.
    """
    _check_positive("page_blocks", page_blocks)
    if reusable_tokens != 0:
        _check_boundary("reusable_tokens", reusable_tokens, block_tokens)
    layout = state_layout(config, block_tokens=block_tokens, dtype=dtype)
    cache = _fresh_cache(config)
    if reusable_tokens == 0:
        return cache
    _check_groups("paged", paged, layout.paged_groups)
    _check_groups("checkpoints", checkpoints, layout.checkpoint_groups)
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    for group in layout.paged_groups:
        tensors.update(layout.unpack_pages(group, paged[group], reusable_tokens, page_blocks))
    for group in layout.checkpoint_groups:
        tensors.update(layout.unpack_checkpoint(group, checkpoints[group], reusable_tokens))
    layout.write(cache, tensors, reusable_tokens, device)
    return cache


# --- helpers -----------------------------------------------------------------------------------


def _pages(
    layout: StateLayout,
    group: str,
    tensors: Mapping[tuple[int, str], torch.Tensor],
    first_block: int,
    n_blocks: int,
    page_blocks: int,
) -> list[bytes]:
    """The group's pages starting in blocks [first_block, n_blocks), all closed."""
    start = -(-first_block // page_blocks) * page_blocks
    if start >= n_blocks:
        return []
    records = layout.block_records(group, tensors, start, n_blocks)
    return [
        records[offset : offset + page_blocks].numpy().tobytes()
        for offset in range(0, n_blocks - start, page_blocks)
    ]


def _smallest_block(config: PreTrainedConfig) -> int:
    """The smallest block size the layout accepts: the lcm of the compression rates, else 1."""
    text = config.get_text_config(decoder=True)
    rates = [1]
    if text.model_type == "deepseek_v4":
        rates += [text.compress_rates[kind] for kind in text.layer_types if kind in (_CSA, _HCA)]
    return int(np.lcm.reduce(rates))


def _fresh_cache(config: PreTrainedConfig) -> DynamicCache:
    """An empty `DynamicCache` for `config`, with its model's own cache layer classes."""
    text = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text)
    if any(kind not in DYNAMIC_LAYER_TYPE_MAPPING for kind in layer_types):
        # Models register their own layer classes (DeepSeek-V4) when their module is imported.
        name = text.model_type
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return DynamicCache(config=config)


def _check_positive(name: str, value: object) -> int:
    """`value`, if it is a positive int (not a bool); LayoutError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_boundary(name: str, n_tokens: object, block_tokens: object) -> None:
    block = _check_positive("block_tokens", block_tokens)
    if _check_positive(name, n_tokens) % block:
        raise LayoutError(
            f"{name} {n_tokens} is not a multiple of block_tokens {block_tokens}: state is"
            " stored at block boundaries only (an open tail is never stored)"
        )


def _check_groups(what: str, given: Mapping[str, Any], expected: tuple[str, ...]) -> None:
    if not isinstance(given, Mapping):
        raise LayoutError(f"{what} must map group names to payloads")
    missing = [g for g in expected if g not in given]
    unknown = sorted(set(given) - set(expected))
    if missing or unknown:
        raise LayoutError(
            f"{what}: the model needs groups {list(expected)}; missing {missing}, unknown {unknown}"
        )


def _cache_dtype(cache: Cache) -> torch.dtype:
    """The model dtype, read from the first key or conv state the cache holds."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor):
            return keys.dtype
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            conv = layer.conv_states.get(0)
            if conv is not None:
                return conv.dtype
    raise LayoutError("the cache holds no state yet: run the prefill first, or pass dtype")


def _batch_one(state: _LayerState, tensor: torch.Tensor | None) -> torch.Tensor:
    if tensor is None:
        raise state._fail("holds no state yet")
    if tensor.shape[0] != 1:
        raise state._fail(f"has batch size {tensor.shape[0]}; a prefix is one sequence (batch 1)")
    return tensor[0]


def _checked(f: Field, tensor: torch.Tensor, n_tokens: int) -> torch.Tensor:
    shape = f.shape if _KINDS[f.group] == CHECKPOINT else (n_tokens // f.tokens_per_row, *f.shape)
    if tuple(tensor.shape) != shape or tensor.dtype != f.dtype:
        raise LayoutError(
            f"{f}: the cache holds {tensor.dtype} {tuple(tensor.shape)}, the layout expects"
            f" {f.dtype} {shape}"
        )
    return tensor


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order, as a flat uint8 CPU tensor."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _from_raw(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `raw` (fresh, writable uint8 memory owned by this module)."""
    return torch.from_numpy(raw).reshape(-1).view(dtype).reshape(shape)


def _byte_view(payload: object, what: str) -> np.ndarray:
    """A flat uint8 view of a payload; no copy, so it may be read-only."""
    if isinstance(payload, str):
        raise LayoutError(f"{what}: a payload must be a byte buffer, got str")
    try:
        view = memoryview(payload)  # type: ignore[arg-type]
    except TypeError:
        raise LayoutError(
            f"{what}: a payload must be a byte buffer, got {type(payload).__name__}"
        ) from None
    if not view.c_contiguous:
        raise LayoutError(f"{what}: the payload buffer is not contiguous")
    return np.frombuffer(
        view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8
    )
