"""Listing a tenant's blocks page by page: every block once, other tenants never, bounded scans."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prefixd import Identity, Store
from prefixd.store import listing

IDENT = Identity(
    model="m",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=2,
    tenant="a",
)
OTHER = dataclasses.replace(IDENT, tenant="b")


def test_pages_list_every_block_of_the_tenant_once(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(listing, "SCAN_LIMIT", 5)  # short pages: the cursor must carry on
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        expected = {}
        for seed in range(20):
            tokens = [100 * seed + i for i in range(4)]
            store.put(IDENT, tokens, [bytes([seed]) * (10 + seed), bytes(3)])
            store.put(OTHER, tokens, [bytes(1), bytes(1)])
            expected[(100 * seed, 100 * seed + 1)] = 10 + seed
            expected[(100 * seed + 2, 100 * seed + 3)] = (
                3  # a child block holds only its own tokens
            )
        seen: list[tuple[tuple[int, ...], int]] = []
        after, pages = None, 0
        while True:
            found, after = store.list_blocks(tenant="a", after=after, limit=3)
            pages += 1
            assert len(found) <= 3
            for block in found:
                assert block.identity == IDENT
                tokens = tuple(int.from_bytes(block.tokens[i : i + 4], "little") for i in (0, 4))
                seen.append((tokens, block.payload_size))
            if after is None:
                break
        assert len(seen) == 40 and dict(seen) == expected  # each block once, b's never
        assert pages >= 80 // 5
        assert store.list_blocks(tenant="nobody") == ([], None)
