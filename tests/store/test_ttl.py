"""Per-tenant time to live: expired entries are unreachable at once and reclaimed later."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixd import Identity, Store
from prefixd.clock import ManualClock
from prefixd.errors import ConfigError, OrphanBlockError

from ..needles import Needles

BASE = {
    "model": "m",
    "weights": "w",
    "tokenizer": "t",
    "template": "c",
    "rope": "r",
    "kv_layout": "bf16",
    "block_tokens": 4,
    "tenant": "short",
}
PROMPT = list(range(100, 116))  # four blocks


def ident(tenant: str) -> Identity:
    return Identity(**{**BASE, "tenant": tenant})


def test_expired_entries_are_unreachable_then_reclaimed(tmp_path: Path) -> None:
    short, forever = ident("short"), ident("forever")
    clock = ManualClock()
    with Store.open(tmp_path / "s", tenant_ttls=("short=0.3s",), clock=clock) as store:
        store.put(short, PROMPT, [b"s" * 100] * 4)
        store.put(forever, PROMPT, [b"f" * 100] * 4)
        assert store.longest_prefix(short, PROMPT).n_blocks == 4
        assert store.cached_prefix(short, PROMPT) is not None  # remembered while fresh
        clock.advance(0.25)
        assert store.longest_prefix(short, PROMPT).n_blocks == 4  # within its 0.3 s
        clock.advance(0.1)
        assert store.cached_prefix(short, PROMPT) is None
        assert store.longest_prefix(short, PROMPT).n_blocks == 0
        assert store.load(short, PROMPT, bytearray(1000)).n_blocks == 0
        assert store.longest_prefix(forever, PROMPT).n_blocks == 4
        with pytest.raises(OrphanBlockError, match="expired"):
            store.put(short, PROMPT, [b"s" * 100], first_block=3)
        assert store.stats().blocks == 8  # unreachable, not yet reclaimed
        assert store.reclaim_expired() == 4
        assert store.stats().blocks == 4 and store.check() == []


def test_a_put_refreshes_an_expired_entry(tmp_path: Path) -> None:
    short = ident("short")
    clock = ManualClock()
    with Store.open(tmp_path / "s", tenant_ttls=("short=0.3s",), clock=clock) as store:
        store.put(short, PROMPT, [b"old!" * 25] * 4)
        clock.advance(0.4)
        result = store.put(short, PROMPT, [b"new!" * 25] * 4)
        assert (result.stored, result.existed) == (4, 0)
        out = bytearray(1000)
        loaded = store.load(short, PROMPT, out)
        assert loaded.n_blocks == 4 and bytes(out[:100]) == b"new!" * 25
        assert store.check() == []


def test_a_read_after_expiry_misses(tmp_path: Path) -> None:
    short = ident("short")
    clock = ManualClock()
    with Store.open(tmp_path / "s", tenant_ttls=("short=0.3s",), clock=clock) as store:
        store.put(short, PROMPT, [b"s" * 100] * 4)
        match = store.longest_prefix(short, PROMPT)
        clock.advance(0.4)
        assert store.read_into(match, [bytearray(100) for _ in range(4)]).n_blocks == 0


@pytest.mark.parametrize("entries", [("short",), ("short=0",), ("short=soon",), ("a=1s", "a=2s")])
def test_bad_ttls(tmp_path: Path, entries: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="tenant_ttls"):
        Store.open(tmp_path / "s", tenant_ttls=entries)


@pytest.mark.parametrize("entries", [("a",), ("a=0",), ("a=lots",), ("a=1KiB", "a=2KiB")])
def test_bad_quotas(tmp_path: Path, entries: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="tenant_quotas"):
        Store.open(tmp_path / "s", tenant_quotas=entries)


@pytest.mark.parametrize("scrub_retired", [True, False])
def test_expired_entries_are_cleared_from_the_files_with_scrub_retired(
    tmp_path: Path, scrub_retired: bool
) -> None:
    """Reclaiming expired entries clears their bytes from every file of the store when asked to;
    without the setting it spends nothing on it and the bytes stay where LMDB left them."""
    needles = Needles(seed=11)  # the tenant's identity row stays (its entries expired, not it)
    short, forever = ident("short-lived-5d1e"), ident("forever")
    clock = ManualClock()
    with Store.open(
        tmp_path / "s",
        tenant_ttls=("short-lived-5d1e=1s",),
        clock=clock,
        scrub_retired=scrub_retired,
    ) as store:
        for _ in range(20):
            store.put(short, needles.tokens(short, 4), needles.payloads(4, 3000))
            store.put(forever, PROMPT, [b"f" * 3000] * 4)
        clock.advance(2)
        assert store.reclaim_expired() == 80
        store.sync()
        left = needles.found(tmp_path / "s")
        assert store.longest_prefix(forever, PROMPT).n_blocks == 4
    if scrub_retired:
        assert left == {}
    else:
        assert left["data.mdb"] > 0
