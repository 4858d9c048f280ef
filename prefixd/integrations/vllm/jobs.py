"""What the direct spec's scheduler side tells a worker of a job (vLLM hands the worker a
LoadStoreSpec per job, pickled when the worker is a process of its own): plain data only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload.base import LoadStoreSpec

from prefixd.integrations.vllm.staging import RegionRef


class PrefixdLoadSpec(LoadStoreSpec):  # type: ignore[misc]
    """A load's chunks, in the job's order (each group's in prefix order, groups in order): for
    every worker rank, the region, offset and size of its verified payload."""

    def __init__(self, chunks: Sequence[Sequence[tuple[RegionRef, int, int]]]) -> None:
        self.chunks = [tuple(by_rank) for by_rank in chunks]

    def __repr__(self) -> str:
        return f"PrefixdLoadSpec({len(self.chunks)} chunks)"


@dataclass(frozen=True)
class StoreGroup:
    """One group's part of a store job: its chain's keys up to the last chunk stored, and the
    places (in the chain) of the chunks stored, in the order of the job's blocks."""

    group: int
    chain: tuple[bytes, ...]
    places: tuple[int, ...]


class PrefixdStoreSpec(LoadStoreSpec):  # type: ignore[misc]
    """Where a store job's chunks go: a chain place per chunk, by group."""

    def __init__(self, groups: Sequence[StoreGroup]) -> None:
        self.groups = list(groups)

    def __repr__(self) -> str:
        return f"PrefixdStoreSpec({sum(len(g.places) for g in self.groups)} chunks)"


__all__ = ["PrefixdLoadSpec", "PrefixdStoreSpec", "StoreGroup"]
