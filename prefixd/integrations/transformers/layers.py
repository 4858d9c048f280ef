"""One class per kind of state a `transformers` cache layer holds: how it splits into fields, how
to read it at a boundary, and how to rebuild it. A hybrid layer holds several (`Joined`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from prefixd.errors import LayoutError

from .fields import COMPRESSED, COMPRESSOR, F32, INDEXER, RECURRENT, WINDOW, Field

POSITION_DIMS = 3  # an indexed layer's position history: [3, batch, tokens] (transformers 5.24)
Named = dict[str, torch.Tensor]  # a layer's tensors by name


class LayerState:
    """The state of one cache layer. Paged state has config-derived `fields`; checkpoint state
    is read as named tensors whose payload describes them, and `check` decides if they fit."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def groups(self) -> set[str]:
        return set()

    def fields(self) -> list[Field]:
        return []

    def group_of(self, name: str) -> str:
        """The checkpoint group of a tensor `read` returns."""
        raise self.fail(f"keeps no checkpoint tensor {name!r}")

    def check(self, group: str, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        """Refuse described tensors of `group` that are not exactly this layer's at n_tokens."""
        if tensors:
            raise self.fail(f"keeps nothing in group {group!r}, the payload has {sorted(tensors)}")

    def read(self, cache_layer: Any, n_tokens: int, row: int, checkpoints: bool) -> Named:
        """The layer's tensors by name for batch row `row`; without `checkpoints`, the paged
        ones only."""
        raise NotImplementedError

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        """Make the fresh `cache_layer` hold exactly the state after `n_tokens` tokens."""
        raise NotImplementedError

    def fail(self, message: str) -> LayoutError:
        return LayoutError(f"layer {self.layer}: {message}")

    def at_end(self, seen: int, n_tokens: int, what: str) -> None:
        if seen != n_tokens:
            raise self.fail(
                f"its {what} exists only at the cache's end, which has seen {seen} tokens, not"
                f" {n_tokens}: capture it with capture_checkpoint when the prefill reaches"
                f" {n_tokens}, and export the pages with checkpoints=False"
            )

    def expect(
        self,
        group: str,
        tensors: Mapping[str, torch.Tensor],
        names: set[str],
        ok: Callable[[str, torch.Tensor], bool],
    ) -> None:
        if set(tensors) != names:
            raise self.fail(f"group {group!r} holds {sorted(tensors)}, the layer {sorted(names)}")
        for name, tensor in tensors.items():
            if not ok(name, tensor):
                raise self.fail(
                    f"group {group!r} {name} is {tensor.dtype} {tuple(tensor.shape)}, which does"
                    " not fit the layer"
                )


class NoState(LayerState):
    """A layer that caches nothing (a KV-sharing consumer, an MLP-only layer)."""

    def read(self, cache_layer: Any, n_tokens: int, row: int, checkpoints: bool) -> Named:
        return {}

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        return None


class FullAttention(LayerState):
    """Keys and values of every token (`DynamicLayer`), and a DSA layer's indexer keys of
    width `indexer`: paged, one row per token. With `positions`, also the position history a
    model may keep there (Qwen4-Exp's indexer ropes its raw keys with it at every step); a cache
    that keeps none stores rows of -1, so one layout serves models with it and without."""

    def __init__(
        self,
        layer: int,
        group: str,
        key_row: tuple[int, ...],
        value_row: tuple[int, ...],
        dtype: torch.dtype,
        indexer: int = 0,
        positions: bool = False,
    ) -> None:
        super().__init__(layer)
        self.group, self.key_row, self.value_row, self.dtype = group, key_row, value_row, dtype
        self.indexer, self.positions = indexer, positions

    def groups(self) -> set[str]:
        return {self.group, INDEXER} if self.indexer else {self.group}

    def fields(self) -> list[Field]:
        out = [
            Field(self.group, self.layer, "keys", self.key_row, self.dtype),
            Field(self.group, self.layer, "values", self.value_row, self.dtype),
        ]
        if self.indexer:
            out.append(Field(INDEXER, self.layer, "indexer_keys", (self.indexer,), self.dtype))
        if self.positions:
            out.append(Field(INDEXER, self.layer, "positions", (POSITION_DIMS,), torch.int64))
        return out

    def read(self, cache_layer: Any, n_tokens: int, row: int, checkpoints: bool) -> Named:
        keys = batch_row(self, cache_layer.keys, row)
        values = batch_row(self, cache_layer.values, row)
        held = keys.shape[-2]
        if held < n_tokens:
            raise self.fail(f"holds {held} tokens, fewer than {n_tokens}")
        # [heads, tokens, dim] -> [tokens, heads, dim]: rows are tokens.
        out = {
            "keys": keys[:, :n_tokens].transpose(0, 1),
            "values": values[:, :n_tokens].transpose(0, 1),
        }
        history = getattr(cache_layer, "indexer_position_ids", None)
        if self.positions:
            out["positions"] = self.read_positions(history, n_tokens, row)
        elif history is not None:
            raise self.fail(
                "keeps a position history, which only the first indexed layer of a model is"
                " expected to keep: a cache restored without it would continue wrong"
            )
        if self.indexer:
            out["indexer_keys"] = batch_row(self, cache_layer.indexer_keys, row)[:n_tokens]
        return out

    def read_positions(self, history: Any, n_tokens: int, row: int) -> torch.Tensor:
        """[tokens, 3] positions of batch row `row`, or rows of -1 where none are kept."""
        if history is None:
            return torch.full((n_tokens, POSITION_DIMS), -1, dtype=torch.int64)
        if history.dim() != 3 or history.shape[0] != POSITION_DIMS:
            raise self.fail(
                f"keeps a position history of shape {tuple(history.shape)}, not"
                f" [{POSITION_DIMS}, batch, tokens]"
            )
        if history.shape[-1] < n_tokens:
            raise self.fail(
                f"its position history holds {history.shape[-1]} tokens, fewer than {n_tokens}"
            )
        return batch_row(self, history.transpose(0, 1), row)[:, :n_tokens].transpose(0, 1)

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        keys = tensors["keys"].transpose(0, 1).unsqueeze(0).contiguous()
        values = tensors["values"].transpose(0, 1).unsqueeze(0).contiguous()
        cache_layer.lazy_initialization(keys, values)
        cache_layer.keys, cache_layer.values = keys, values
        if self.indexer:
            indexer = tensors["indexer_keys"].unsqueeze(0).contiguous()
            cache_layer.lazy_initialization_indexer(indexer)
            cache_layer.indexer_keys = indexer
        if self.positions:
            cache_layer.indexer_position_ids = self.write_positions(tensors["positions"])

    def write_positions(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The [3, 1, tokens] history from stored rows; None where the cache kept none."""
        if bool((rows == -1).all()):
            return None
        if bool((rows < 0).any()):
            raise self.fail("its stored position history mixes kept and missing positions")
        return rows.transpose(0, 1).unsqueeze(1).contiguous()


class SlidingAttention(LayerState):
    """A sliding window: the last `window - 1` tokens' keys/values, [heads, tokens, dim] each.
    With `shared_kv` (DeepSeek-V4's MQA) the values are the keys, stored once."""

    def __init__(self, layer: int, window: int, dtype: torch.dtype, *, shared_kv: bool) -> None:
        super().__init__(layer)
        self.window, self.dtype, self.shared_kv = window, dtype, shared_kv

    def kept(self, n_tokens: int) -> int:
        return min(self.window - 1, n_tokens)

    def groups(self) -> set[str]:
        return {WINDOW}

    def group_of(self, name: str) -> str:
        return WINDOW

    def check(self, group: str, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        names = {"keys"} if self.shared_kv else {"keys", "values"}
        kept = self.kept(n_tokens)
        self.expect(
            group,
            tensors,
            names,
            lambda name, t: t.dtype == self.dtype and t.dim() == 3 and t.shape[1] == kept,
        )

    def read(self, cache_layer: Any, n_tokens: int, row: int, checkpoints: bool) -> Named:
        if not checkpoints:
            return {}
        self.at_end(cache_layer.cumulative_length, n_tokens, "sliding window")
        keys = batch_row(self, cache_layer.keys, row)
        if keys.shape[-2] != self.kept(n_tokens):
            raise self.fail(
                f"holds {keys.shape[-2]} window tokens, not the last {self.kept(n_tokens)}"
                " (was it rebuilt through update() or recording its past?)"
            )
        if self.shared_kv:
            return {"keys": keys}
        return {"keys": keys, "values": batch_row(self, cache_layer.values, row)}

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        keys = tensors["keys"].unsqueeze(0)
        values = keys if self.shared_kv else tensors["values"].unsqueeze(0)
        cache_layer.lazy_initialization(keys, values)
        cache_layer.keys, cache_layer.values = keys, values
        cache_layer.cumulative_length = n_tokens


class LinearStates(LayerState):
    """A linear-attention layer's states, each a conv state, a recurrent state or both (named
    `conv.<i>`, `recurrent.<i>`), of the mixer's own shapes."""

    def __init__(self, layer: int, states: int, dtype: torch.dtype) -> None:
        super().__init__(layer)
        self.states, self.dtype = states, dtype

    def groups(self) -> set[str]:
        return {RECURRENT}

    def group_of(self, name: str) -> str:
        return RECURRENT

    def read(self, cache_layer: Any, n_tokens: int, row: int, checkpoints: bool) -> Named:
        if not checkpoints:
            return {}
        if getattr(cache_layer, "record_past", False):
            raise self.fail("records its past: crop it before capturing a checkpoint")
        out = {}
        for index in range(self.states):
            if not cache_layer.has_previous_state[index]:
                raise self.fail(
                    f"linear-attention state {index} holds nothing: run the prefill first (a"
                    " family that keeps its recurrent state in its modules, outside the cache,"
                    " cannot be stored)"
                )
            for name in ("conv", "recurrent"):
                tensor = getattr(cache_layer, f"{name}_states")[index]
                if tensor is not None:
                    out[f"{name}.{index}"] = batch_row(self, tensor, row)
        return out

    def check(self, group: str, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        """A conv state is in the model dtype (a recurrent state may be kept in float32)."""
        names = set(tensors)
        allowed = {f"{kind}.{i}" for kind in ("conv", "recurrent") for i in range(self.states)}
        empty = [i for i in range(self.states) if not {f"conv.{i}", f"recurrent.{i}"} & names]
        if names - allowed or empty:
            raise self.fail(
                f"the recurrent payload does not match the layer's {self.states} state(s):"
                f" unknown {sorted(names - allowed)}, empty states {empty}"
            )
        for name, tensor in tensors.items():
            if name.startswith("conv.") and tensor.dtype != self.dtype:
                raise self.fail(f"{name} is {tensor.dtype}, the model {self.dtype}")

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        for index in range(self.states):
            conv, recurrent = tensors.get(f"conv.{index}"), tensors.get(f"recurrent.{index}")
            if conv is not None:
                conv = conv.unsqueeze(0)
                cache_layer.lazy_initialization(
                    conv_states=conv, state_idx=index, conv_kernel_size=conv.shape[-1]
                )
                # Copied into the layer's own tensor, which keeps its static address.
                cache_layer.conv_states[index].copy_(conv)
            if recurrent is not None:
                recurrent = recurrent.unsqueeze(0)
                cache_layer.lazy_initialization(recurrent_states=recurrent, state_idx=index)
                cache_layer.recurrent_states[index].copy_(recurrent)
            cache_layer.has_previous_state[index] = True


class Joined(LayerState):
    """A hybrid layer (attention and linear attention in one): its parts, whose tensor names do
    not collide."""

    def __init__(self, layer: int, parts: list[LayerState]) -> None:
        super().__init__(layer)
        self.parts = parts

    def groups(self) -> set[str]:
        return set().union(*(part.groups() for part in self.parts))

    def fields(self) -> list[Field]:
        return [f for part in self.parts for f in part.fields()]

    def group_of(self, name: str) -> str:
        return self._part(name).group_of(name)

    def check(self, group: str, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        for part in self.parts:
            if group in part.groups():
                part.check(group, tensors, n_tokens)
                return
        super().check(group, tensors, n_tokens)

    def _part(self, name: str) -> LayerState:
        linear = name.startswith(("conv.", "recurrent."))
        for part in self.parts:
            if isinstance(part, LinearStates) == linear:
                return part
        raise self.fail(f"keeps no checkpoint tensor {name!r}")

    def read(self, cache_layer: Any, n_tokens: int, row: int, checkpoints: bool) -> Named:
        out: Named = {}
        for part in self.parts:
            out.update(part.read(cache_layer, n_tokens, row, checkpoints))
        return out

    def write(self, cache_layer: Any, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        for part in self.parts:
            part.write(cache_layer, tensors, n_tokens)


class CompressedAttention(LayerState):
    """A DeepSeek-V4 CSA or HCA layer: a shared-KV sliding window, and an entry per closed block
    of `rate` tokens (paged). A CSA layer also keeps lightning-indexer keys (paged) and the last
    closed window's Ca slice, which the next entry overlaps (the `compressor` checkpoint; its gate
    is float32 because the position bias added to it is)."""

    def __init__(
        self,
        layer: int,
        window: SlidingAttention,
        rate: int,
        dims: dict[str, int],
        dtype: torch.dtype,
    ) -> None:
        super().__init__(layer)
        self.window, self.rate, self.dims, self.dtype = window, rate, dims, dtype
        self.overlaps = "indexer" in dims  # CSA: windows overlap their predecessor

    def groups(self) -> set[str]:
        out = {WINDOW, COMPRESSED}
        return out | {INDEXER, COMPRESSOR} if self.overlaps else out

    def fields(self) -> list[Field]:
        return [
            Field(group, self.layer, name, (dim,), self.dtype, self.rate)
            for name, dim in self.dims.items()
            for group in [COMPRESSED if name == "compressor" else INDEXER]
        ]

    def group_of(self, name: str) -> str:
        return COMPRESSOR if ".overlap_" in name else WINDOW

    def check(self, group: str, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
        if group == WINDOW:
            self.window.check(group, tensors, n_tokens)
            return
        shapes = {}
        for name, dim in self.dims.items():
            shapes[f"{name}.overlap_kv"] = ((self.rate, dim), self.dtype)
            shapes[f"{name}.overlap_gate"] = ((self.rate, dim), F32)
        self.expect(
            group,
            tensors,
            set(shapes) if self.overlaps else set(),
            lambda name, t: (tuple(t.shape), t.dtype) == shapes[name],
        )

    def read(self, cache_layer: Any, n_tokens: int, row: int, checkpoints: bool) -> Named:
        out = self.window.read(cache_layer, n_tokens, row, checkpoints)
        wanted = n_tokens // self.rate
        for name in self.dims:
            entries = cache_layer.entry_count[name]
            if entries < wanted:
                raise self.fail(f"holds {entries} {name} entries, fewer than {wanted}")
            out[name] = batch_row(self, cache_layer.compressed_kv[name], row)[:wanted]
            if not checkpoints:
                continue
            buffered = cache_layer.buffer_kv[name]
            if buffered is not None and buffered.shape[1]:
                raise self.fail(
                    f"the {name} block of {self.rate} tokens is still open ({buffered.shape[1]}"
                    f" tokens buffered): boundaries must be multiples of {self.rate} tokens"
                )
            if self.overlaps:
                out[f"{name}.overlap_kv"] = batch_row(self, cache_layer.overlap_kv[name], row)
                out[f"{name}.overlap_gate"] = batch_row(self, cache_layer.overlap_gate[name], row)
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


def batch_row(state: LayerState, tensor: torch.Tensor | None, row: int) -> torch.Tensor:
    if tensor is None or tensor.dim() == 0 or tensor.numel() == 0 and tensor.dim() == 1:
        raise state.fail("holds no state yet")
    if not 0 <= row < tensor.shape[0]:
        raise state.fail(f"has batch size {tensor.shape[0]}, no row {row}")
    return tensor[row]
