"""A request's prompt from a `transformers` processor's inputs: the token ids, and each multimodal
item's content hash and the placeholder tokens it expands into, so the blocks an image's
placeholders fall in are named by that image (prefixd.schema.content).

An item is a run of one modality's placeholder token (the config's `image_token_id`, ...). Its
hash is taken over the processed tensor the model reads (pixel values, audio features): the
identity's `mm` names the preprocessing, so equal inputs are equal images. Where a modality's
tensor cannot be told apart per run (two images back to back, a layout the processor does not say),
each of its runs is hashed with the whole tensor: coarser reuse, never another image's state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedConfig

from prefixd.errors import LayoutError
from prefixd.schema.tokens import MediaItem, Prompt

# modality: (its placeholder token's config attributes, the inputs that carry its content)
MODALITIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "image": (("image_token_id", "image_token_index"), ("pixel_values", "image_grid_thw")),
    "video": (("video_token_id", "video_token_index"), ("pixel_values_videos", "video_grid_thw")),
    "audio": (("audio_token_id", "audio_token_index"), ("input_features", "input_values")),
}


def prompt_of(
    inputs: Mapping[str, Any],
    config: PreTrainedConfig,
    *,
    row: int = 0,
    adapter: str | None = None,
    salt: str | None = None,
) -> Prompt:
    """The prompt of batch row `row` of a processor's `inputs` (its `input_ids` and media
    tensors), with the request's `adapter` and cache `salt`."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not 0 <= row < ids.shape[0]:
        raise LayoutError(f"inputs need input_ids of shape (batch, tokens) with row {row}")
    tokens = ids[row].cpu().numpy().astype(np.int64)
    items: list[MediaItem] = []
    for modality, (token_names, tensor_names) in MODALITIES.items():
        placeholder = next(
            (v for n in token_names if isinstance(v := getattr(config, n, None), int)), None
        )
        runs = [] if placeholder is None else _runs(tokens == placeholder)
        tensors = [inputs[n] for n in tensor_names if isinstance(inputs.get(n), torch.Tensor)]
        if runs and not tensors:
            raise LayoutError(
                f"input_ids hold {modality} placeholders but the inputs carry no "
                f"{' or '.join(tensor_names)}: the prompt's {modality} content is unknown"
            )
        for (offset, length), digest in zip(runs, _item_hashes(tensors, len(runs))):
            items.append(MediaItem(f"{modality}:{digest}", offset, length))
    return Prompt(tokens, tuple(items), adapter, salt)


def _runs(marks: np.ndarray) -> list[tuple[int, int]]:
    """(offset, length) of each run of True in `marks`."""
    edges = np.diff(np.concatenate(([0], marks.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def _item_hashes(tensors: list[torch.Tensor], n_runs: int) -> list[str]:
    """One hash per run: of its own slice of the first tensor when there is one per run (a row,
    or the rows a grid says), else of every tensor whole."""
    if not n_runs:
        return []
    values, grid = tensors[0], tensors[1] if len(tensors) > 1 else None
    if grid is not None and grid.dim() == 2 and grid.shape[0] == n_runs:
        sizes = grid.prod(dim=1).tolist()
        if sum(sizes) == values.shape[0]:
            return [_digest(part) for part in torch.split(values, sizes)]
    if grid is None and values.dim() >= 1 and values.shape[0] == n_runs:
        return [_digest(values[i]) for i in range(n_runs)]
    whole = _digest(*tensors)
    return [f"{whole}#{i}" for i in range(n_runs)]


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        array = tensor.detach().cpu().contiguous()
        h.update(f"{array.dtype}{tuple(array.shape)}".encode())
        h.update(array.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


__all__ = ["MODALITIES", "prompt_of"]
