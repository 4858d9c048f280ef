"""What differs between the vLLM releases prefixd is tested against (0.32, 0.33, 0.34), in one
place: everything else in this package is written against the offloading API they share.

- 0.34 hands an OffloadingWorker the KV cache blocks of a job as `DevicePointers` (one address per
  block and layer) instead of a `GPULoadStoreSpec` (block ids per group), and adds `expedited` to
  `submit_load`; `blocks_of` reads either.
- 0.33 and 0.34 add a `lock` to OffloadingManager (the default, no lock, fits the tier and the
  spec: vLLM's scheduler thread is the only caller; their own threads only exchange queues) and
  drop `touch` (neither implements it); 0.34 adds `config_info` with a default.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class JobBlocks(NamedTuple):
    """A job's KV cache blocks: ids in group order, how many per group, and the index of each
    group's first block in the request."""

    block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def blocks_of(device: Any, kv_caches: Any) -> JobBlocks:
    """The blocks of `device`, a GPULoadStoreSpec (vLLM 0.32, 0.33) or DevicePointers (0.34,
    addresses resolved from the same ids against `kv_caches`: block = (address - base) / row)."""
    if not hasattr(device, "ptrs"):
        return JobBlocks(
            np.asarray(device.block_ids, dtype=np.int64),
            tuple(int(n) for n in device.group_sizes),
            tuple(int(i) for i in device.block_indices),
        )
    ids: list[np.ndarray] = []
    at = 0
    sizes = tuple(int(n) for n in device.group_block_counts)
    for size, refs, layers in zip(
        sizes, kv_caches.group_data_refs, device.group_data_ref_counts, strict=True
    ):
        if size == 0:
            continue
        tensor = kv_caches.tensors[refs[0].tensor_idx].tensor  # a group's layers share its ids
        base, row = np.uint64(tensor.data_ptr()), np.uint64(tensor.stride(0))
        ids.append(((device.ptrs[at : at + size] - base) // row).astype(np.int64))
        at += size * int(layers)
    block_ids = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    return JobBlocks(block_ids, sizes, tuple(int(i) for i in device.block_indices))


__all__ = ["JobBlocks", "blocks_of"]
