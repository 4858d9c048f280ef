"""prefixd behind SGLang's own storage code: the factory, real CPU host pools (layer-first and
page-first) and the controller's hit query, backup and prefetch transfer (tests/integrations/
sglang/harness.py), against a real daemon that is restarted and damaged."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage import StorageBackendFactory

from prefixd.client import Client
from prefixd.errors import ConfigError
from prefixd.integrations.sglang.backend import PrefixdHiCache
from prefixd.schema.chain import chain_hashes
from prefixd.schema.keys import pack_keys

from ...daemon.conftest import Daemon, DaemonFactory
from ...store.test_faults import corrupt_stored_chunk
from .harness import (
    PAGE,
    Controller,
    fill,
    host_pool,
    page_hashes,
    pages_of,
    prefixd_extra,
    storage_config,
)

LAYOUTS = ["layer_first", "page_first"]
INTERFACES = {"v0": 0, "v1": 1}


def tokens_of(n_pages: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n_pages * PAGE,), generator=generator).tolist()


def stored(controller: Controller, n_pages: int, seed: int = 1) -> tuple[list[int], list[bytes]]:
    """Fill n_pages host pages with seeded KV and back them up through the controller."""
    tokens = tokens_of(n_pages)
    slots = controller.pool.alloc(n_pages * PAGE)
    fill(controller.pool, slots, seed)
    assert controller.backup(tokens, slots) == n_pages * PAGE
    return tokens, pages_of(controller.pool, slots)


def test_the_factory_loads_prefixd_as_a_dynamic_backend(daemon: Daemon) -> None:
    pool = host_pool("layer_first")
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(prefixd_extra(daemon.socket)), pool
    )
    assert isinstance(backend, PrefixdHiCache) and isinstance(backend, HiCacheStorage)
    backend.close()


def test_it_refuses_to_start_without_a_weights_identity_or_a_socket(daemon: Daemon) -> None:
    pool = host_pool("layer_first")
    no_weights = prefixd_extra(daemon.socket, weights="")
    with pytest.raises(ConfigError, match="weights"):
        StorageBackendFactory.create_backend("dynamic", storage_config(no_weights), pool)
    no_socket = prefixd_extra("", weights="rev=1")
    with pytest.raises(ConfigError, match="socket"):
        StorageBackendFactory.create_backend("dynamic", storage_config(no_socket), pool)


@pytest.mark.parametrize("interface", INTERFACES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_byte_exact_across_a_daemon_restart(
    daemon: Daemon, layout: str, interface: str
) -> None:
    extra = prefixd_extra(daemon.socket, interface_v1=INTERFACES[interface])
    writer = Controller(host_pool(layout), extra)
    tokens, pages = stored(writer, 5)
    writer.close()
    daemon.restart()
    reader = Controller(host_pool(layout), extra)  # a fresh engine: an empty host pool
    assert reader.hit(tokens) == 5 * PAGE
    slots = reader.pool.alloc(5 * PAGE)
    slots = torch.flip(slots.view(-1, PAGE), [0]).reshape(-1)  # other slots than the writer's
    assert reader.prefetch(tokens, slots) == 5 * PAGE
    assert pages_of(reader.pool, slots) == pages
    reader.close()


@pytest.mark.parametrize("interface", INTERFACES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_is_stored_is_sglangs_flat_page(daemon: Daemon, layout: str, interface: str) -> None:
    """v1 copies host pages straight from the pool's strided view into the region, v0 from the
    controller's flat tensors: the daemon holds SGLang's flat page (get_data_page) either way."""
    extra = prefixd_extra(daemon.socket, interface_v1=INTERFACES[interface])
    controller = Controller(host_pool(layout), extra)
    tokens, pages = stored(controller, 3)
    identity = controller.backend._identities()[0]["kv"]
    keys = [bytes.fromhex(h) for h in page_hashes(tokens)]
    chains = [keys] if interface == "v1" else [[k] for k in keys]  # v0: a chain per page
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        found = []
        for chain in chains:
            with client.load(identity, pack_keys(identity, chain)) as loaded:
                found += [bytes(view) for view in loaded.views]
    assert found == pages
    controller.close()


def test_pages_not_worth_loading_are_recomputed_and_counted(
    daemon_factory: DaemonFactory,
) -> None:
    """With a prefill faster than any load, SGLang is told no page exists (it recomputes them),
    and the daemon counts the hit it held back."""
    daemon = daemon_factory("--prefill-tokens-per-s", "1e9")
    controller = Controller(host_pool("layer_first"), prefixd_extra(daemon.socket))
    tokens, _ = stored(controller, 4)
    assert controller.hit(tokens) == 0
    controller.close()
    with Client(daemon.socket) as client:
        assert client.stats()["store"]["blocks"] >= 4
        tenants = client.stats()["metrics"]["tenants"]
    assert sum(t.get("loads_skipped", 0) for t in tenants.values()) >= 1


def test_a_hit_never_reaches_past_a_missing_page(daemon: Daemon) -> None:
    controller = Controller(host_pool("layer_first"), prefixd_extra(daemon.socket))
    tokens, _ = stored(controller, 4)
    # the same first two pages, then other tokens: SGLang's chained hashes differ from page 3 on
    other = tokens[: 2 * PAGE] + tokens_of(2, seed=9)
    assert controller.hit(other) == 2 * PAGE
    # pages whose parents were never stored are refused: the backup stores nothing
    orphans = tokens_of(2, seed=5)
    prefix = page_hashes(tokens_of(1, seed=6))
    slots = controller.pool.alloc(2 * PAGE)
    assert controller.backup(orphans, slots, prefix=prefix) == 0
    assert controller.hit(orphans, prefix=prefix) == 0
    controller.close()


@pytest.mark.damages_store
def test_a_corrupted_page_is_a_miss_from_there_on(daemon: Daemon) -> None:
    extra = prefixd_extra(daemon.socket)
    writer = Controller(host_pool("layer_first"), extra)
    tokens, pages = stored(writer, 5)
    identity = writer.backend._identities()[0]["kv"]
    blocks = chain_hashes(
        identity, pack_keys(identity, [bytes.fromhex(h) for h in page_hashes(tokens)])
    )
    writer.close()
    daemon.stop()
    corrupt_stored_chunk(daemon.data_dir, blocks[2])
    daemon.start()
    reader = Controller(host_pool("layer_first"), extra)
    slots = reader.pool.alloc(5 * PAGE)
    # the hit query finds every page; the transfer verifies and stops at the damaged one
    assert reader.prefetch(tokens, slots) == 2 * PAGE
    assert pages_of(reader.pool, slots[: 2 * PAGE]) == pages[:2]
    assert reader.hit(tokens) == 2 * PAGE  # quarantined: a miss at the hit query already
    reader.close()


def test_the_identity_keys_on_more_than_sglang_does(daemon: Daemon) -> None:
    """SGLang's file backend keys on the model name and parallelism only; prefixd's identity
    also carries the weights, tokenizer, template, tenant, KV layout and tp rank: any of them
    changed is a miss. Each tp rank reads its own part, and a page is a hit once both parts are
    stored (test_ranks.py). MLA KV, whole on every rank, is shared by the ranks."""
    base = prefixd_extra(daemon.socket, tokenizer="tok@1", template="tpl@1")
    rank0 = {"tp_rank": 0, "tp_size": 2}
    writer = Controller(host_pool("layer_first"), base, **rank0)
    tokens, _ = stored(writer, 2)
    other = Controller(host_pool("layer_first"), base, tp_rank=1, tp_size=2)
    _, pages1 = stored(other, 2, seed=2)
    assert Controller(host_pool("layer_first"), base, **rank0).hit(tokens) == 2 * PAGE
    for changed in (
        {"weights": "rev=other"},
        {"tokenizer": "t2"},
        {"template": "chat-v2"},
        {"tenant": "other"},
    ):
        assert Controller(host_pool("layer_first"), {**base, **changed}, **rank0).hit(tokens) == 0
    assert Controller(host_pool("page_first"), base, **rank0).hit(tokens) == 0  # KV layout
    assert Controller(host_pool("layer_first", layers=2), base, **rank0).hit(tokens) == 0
    rank1 = Controller(host_pool("layer_first"), base, tp_rank=1, tp_size=2)
    slots = rank1.pool.alloc(2 * PAGE)
    assert rank1.prefetch(tokens, slots) == 2 * PAGE
    assert pages_of(rank1.pool, slots) == pages1  # its own part, not the writer's
    assert Controller(host_pool("layer_first"), base, tp_rank=1, tp_size=4).hit(tokens) == 0
    mla = Controller(host_pool("layer_first"), base, mla=True, **rank0)
    tokens, _ = stored(mla, 2, seed=4)
    assert (
        Controller(host_pool("layer_first"), base, mla=True, tp_rank=1, tp_size=2).hit(tokens)
        == 2 * PAGE
    )
    writer.close()


def test_a_daemon_that_is_away_is_a_miss_and_a_failed_store_never_an_error(
    daemon: Daemon,
) -> None:
    controller = Controller(host_pool("page_first"), prefixd_extra(daemon.socket))
    tokens = tokens_of(2)
    assert controller.hit(tokens) == 0  # connected: the daemon goes away under a connection
    daemon.stop()
    slots = controller.pool.alloc(2 * PAGE)
    assert controller.hit(tokens) == 0
    assert controller.backup(tokens, slots) == 0
    daemon.start()
    assert controller.backup(tokens, slots) == 2 * PAGE  # connected again
    assert controller.hit(tokens) == 2 * PAGE
    controller.close()
