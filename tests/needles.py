"""Needles: distinctive bytes of one tenant's entries, and a scan of every file of a store for them.

Payloads are random, so incompressible: zstd stores them as they are (or raw), and any 32-byte piece
of one found in a file is that payload's. Token ids are random too: one block's packed ids (16 bytes
at four tokens a block) occur nowhere by chance; an engine key is 36 random bytes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from prefixd.schema.identity import Identity
from prefixd.schema.keys import pack_keys

PIECE = 32
STRIDE = 256  # one piece every 256 bytes of a payload


class Needles:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.pieces: set[bytes] = set()

    def name(self, tenant: str) -> str:
        self.pieces.add(tenant.encode())
        return tenant

    def payloads(self, n: int, size: int, *, planted: bool = True) -> list[bytes]:
        found = [self.rng.bytes(size) for _ in range(n)]
        if planted:
            for payload in found:
                self.pieces.update(
                    payload[at : at + PIECE] for at in range(0, size - PIECE + 1, STRIDE)
                )
        return found

    def tokens(self, identity: Identity, blocks: int, *, planted: bool = True) -> np.ndarray:
        found = self.rng.integers(1 << 20, 1 << 31, blocks * identity.block_tokens, np.uint32)
        if planted:
            step = identity.block_tokens
            self.pieces.update(found[i : i + step].tobytes() for i in range(0, len(found), step))
        return found

    def keys(self, identity: Identity, blocks: int) -> bytes:
        """An engine-keyed identity's packed keys (its block keys are needles)."""
        assert identity.key_bytes is not None
        keys = [self.rng.bytes(identity.key_bytes) for _ in range(blocks)]
        self.pieces.update(keys)
        return pack_keys(identity, keys)

    def found(self, store_dir: Path) -> dict[str, int]:
        """How many needles each file under `store_dir` holds (files holding none left out)."""
        counts = {}
        for root, _, names in os.walk(store_dir):
            for name in names:
                hits = self.count_in((Path(root) / name).read_bytes())
                if hits:
                    counts[name] = hits
        return counts

    def count_in(self, data: bytes) -> int:
        """How many needles `data` holds: each needle's first 8 bytes are looked for at every
        offset at once (numpy, one pass per byte alignment), then the candidates compared whole;
        needles shorter than 8 bytes by a plain search."""
        short = {piece for piece in self.pieces if len(piece) < 8}
        by_head: dict[int, list[bytes]] = {}
        for piece in self.pieces - short:
            by_head.setdefault(int.from_bytes(piece[:8], "little"), []).append(piece)
        heads = np.fromiter(by_head, dtype=np.uint64, count=len(by_head))
        hits = {piece for piece in short if piece in data}
        for align in range(min(8, len(data))):  # an empty file (owner.lock, unheld) has none
            words = np.frombuffer(data, dtype="<u8", count=(len(data) - align) // 8, offset=align)
            for index in np.flatnonzero(np.isin(words, heads)):
                at = align + 8 * int(index)
                for piece in by_head[int(words[index])]:
                    if data[at : at + len(piece)] == piece:
                        hits.add(piece)
        return len(hits)
