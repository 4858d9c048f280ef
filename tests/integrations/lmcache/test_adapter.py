"""PrefixdL2Adapter through LMCache's own L2 adapter interface (lmcache 0.5.6), against a real
daemon: round trips into memory objects, lock until unlock against prefixd's eviction, a damaged
payload a miss, the daemon's accounting behind delete / list_l2_keys / get_usage, and the
daemon going away and coming back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

from prefixd import Store
from prefixd.client import Client
from prefixd.errors import ConfigError
from prefixd.integrations.lmcache import PrefixdL2Adapter, adapter, key_of, l2_adapter_config
from prefixd.integrations.lmcache.identity import Identities, Settings, layout_of
from prefixd.schema.chain import chain_hashes

from ...daemon.conftest import Daemon, DaemonFactory
from ...store.test_faults import corrupt_stored_chunk
from ...waiting import wait_for
from .harness import (
    DEADLINE_S,
    MODEL,
    adapter_params,
    keys,
    load,
    lookup_and_lock,
    memory_obj,
    payload_objs,
    store,
    typed_obj,
    uint8_layout,
)

SIZE = 48 << 10
# room for about 8 objects, least recently read first: each store below evicts older ones
SMALL = ("--capacity-bytes", str(8 * SIZE), "--low-watermark", "0.5", "--eviction", "lru")


def loaded_bytes(adapter: Any, ks: list[Any], size: int = SIZE) -> tuple[list[bool], list[bytes]]:
    outs = [memory_obj(size, fill=0xEE) for _ in ks]
    bits = load(adapter, ks, outs)
    return bits, [bytes(o.byte_array) for o in outs]


def test_the_plugin_loads_through_lmcaches_factory_and_round_trips(daemon: Daemon) -> None:
    """LMCache's own config parser and plugin factory build the adapter from the JSON the
    node server gets; stored objects come back byte for byte into fresh memory objects."""
    import argparse
    import json

    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args

    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    spec = json.dumps(l2_adapter_config(str(daemon.socket), weights="sha256:test"))
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", spec]))
    adapter = create_l2_adapter_from_registry(config.adapters[0])
    assert isinstance(adapter, PrefixdL2Adapter) and isinstance(adapter, L2AdapterInterface)
    fds = {
        adapter.get_store_event_fd(),
        adapter.get_lookup_and_lock_event_fd(),
        adapter.get_load_event_fd(),
    }
    assert len(fds) == 3
    try:
        ks, objs = keys(6), payload_objs(6, SIZE)
        result = store(adapter, ks, objs)
        assert result.is_successful() and result.bytes_transferred() == 6 * SIZE
        again = store(adapter, ks, objs)  # already stored: nothing written again
        assert again.is_successful() and again.bytes_transferred() == 0
        probe = ks[:3] + keys(2, start=100) + ks[3:]
        assert lookup_and_lock(adapter, probe) == [True] * 3 + [False] * 2 + [True] * 3
        adapter.submit_unlock(ks)
        bits, got = loaded_bytes(adapter, probe)
        assert bits == [True] * 3 + [False] * 2 + [True] * 3
        expected = [bytes(o.byte_array) for o in objs]
        assert got[:3] + got[5:] == expected
        assert got[3] == got[4] == b"\xee" * SIZE  # a miss leaves the memory object alone
    finally:
        adapter.close()


def test_each_key_field_is_part_of_the_name(daemon: Daemon) -> None:
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        [key] = keys(1)
        assert store(adapter, [key], payload_objs(1, SIZE)).is_successful()
        import dataclasses

        others = [
            dataclasses.replace(key, kv_rank=1),
            dataclasses.replace(key, object_group_id=1),
            dataclasses.replace(key, cache_salt="alice"),
            dataclasses.replace(key, model_name="other/model"),
            dataclasses.replace(key, chunk_hash=key.chunk_hash[:16]),
        ]
        assert lookup_and_lock(adapter, [key, *others]) == [True] + [False] * len(others)
        adapter.submit_unlock([key])
    finally:
        adapter.close()
    other_weights = PrefixdL2Adapter(adapter_params(daemon.socket) | {"weights": "sha256:v2"})
    try:
        assert lookup_and_lock(other_weights, [key]) == [False]  # another version of the model
    finally:
        other_weights.close()


def test_it_refuses_to_start_without_a_weights_identity(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs `weights`"):
        PrefixdL2Adapter({"socket": str(tmp_path / "s")})
    with pytest.raises(ConfigError, match="unknown"):
        PrefixdL2Adapter({"socket": str(tmp_path / "s"), "weights": "w", "weight": "w"})
    with pytest.raises(ConfigError, match="tokenizer must be text"):
        PrefixdL2Adapter({"socket": str(tmp_path / "s"), "weights": "w", "tokenizer": 5})
    for lanes in (0, 17, "2", True):
        with pytest.raises(ConfigError, match="load_lanes must be from 1 to 16"):
            PrefixdL2Adapter({"socket": str(tmp_path / "s"), "weights": "w", "load_lanes": lanes})
    with pytest.raises(ConfigError, match="config.json"):
        PrefixdL2Adapter({"socket": str(tmp_path / "s"), "weights_from": str(tmp_path)})
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"v1")
    first = Settings.from_params({"socket": "s", "weights_from": str(tmp_path)}).weights
    (tmp_path / "model.safetensors").write_bytes(b"v2")
    second = Settings.from_params({"socket": "s", "weights_from": str(tmp_path)}).weights
    assert first.startswith("local:sha256:") and first != second


def test_the_model_directorys_preprocessing_files_are_part_of_the_identity(
    tmp_path: Path,
) -> None:
    """An image processor's config edited in place makes other embeddings of an image whose
    hash (in the chunk hash) stays the same: another identity, as other weights are."""
    (tmp_path / "config.json").write_text("{}")

    def identity() -> Any:
        settings = Settings.from_params({"socket": "s", "weights_from": str(tmp_path)})
        return Identities(settings).of("m", 32, "", "uint8[64]")

    assert identity().mm is None  # a text model's
    processor = tmp_path / "preprocessor_config.json"
    processor.write_text('{"image_mean": [0.5, 0.5, 0.5]}')
    before = identity()
    assert before == identity() and before.mm is not None
    processor.write_text('{"image_mean": [0.48, 0.46, 0.41]}')
    assert identity().mm != before.mm and identity().weights == before.weights
    with pytest.raises(ConfigError, match="unknown"):  # read from the files, never given
        Settings.from_params({"socket": "s", "weights": "w", "mm": "x"})


def test_a_locked_key_outlives_prefixds_eviction_until_it_is_unlocked(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(*SMALL)
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        locked, objs = keys(2), payload_objs(2, SIZE, seed=1)
        assert store(adapter, locked, objs).is_successful()
        assert lookup_and_lock(adapter, locked) == [True, True]
        for round_ in range(5):  # 40 more objects through a store that holds 8
            assert store(
                adapter, keys(8, start=100 + 8 * round_), payload_objs(8, SIZE)
            ).is_successful()
        assert lookup_and_lock(adapter, keys(8, start=100)) == [False] * 8  # others went
        bits, got = loaded_bytes(adapter, locked)
        assert bits == [True, True] and got == [bytes(o.byte_array) for o in objs]
        adapter.submit_unlock(locked)  # both unlocked
        assert lookup_and_lock(adapter, locked[:1]) == [True]  # the first locked again
        for round_ in range(5):
            assert store(
                adapter, keys(8, start=200 + 8 * round_), payload_objs(8, SIZE)
            ).is_successful()
        assert lookup_and_lock(adapter, locked) == [True, False]  # still locked / evicted
        adapter.submit_unlock(locked[:1])
        adapter.submit_unlock(locked[:1])
    finally:
        adapter.close()


def test_a_damaged_payload_is_a_miss_never_wrong_bytes(daemon: Daemon) -> None:
    params = adapter_params(daemon.socket)
    adapter = PrefixdL2Adapter(params)
    ks, objs = keys(3), payload_objs(3, SIZE, seed=2)
    try:
        assert store(adapter, ks, objs).is_successful()
    finally:
        adapter.close()
    daemon.stop()
    identity = Identities(Settings.from_params(params)).of(MODEL, 32, "", f"uint8[{SIZE}]")
    assert identity is not None
    [damaged] = chain_hashes(identity, key_of(ks[1].chunk_hash, 0, 0))
    corrupt_stored_chunk(daemon.data_dir, damaged)
    daemon.start()
    adapter = PrefixdL2Adapter(params)
    try:
        bits, got = loaded_bytes(adapter, ks)
        assert bits == [True, False, True]
        assert got[0] == bytes(objs[0].byte_array) and got[2] == bytes(objs[2].byte_array)
        assert got[1] == b"\xee" * SIZE
        assert lookup_and_lock(adapter, ks) == [True, False, True]  # quarantined: gone
        adapter.submit_unlock(ks)
    finally:
        adapter.close()
    daemon.stop()
    with Store.open(daemon.data_dir) as opened:
        assert opened.stats().quarantined == 1


def test_a_chunk_not_worth_loading_is_a_miss_counted_and_still_deletable(
    daemon_factory: DaemonFactory,
) -> None:
    """With a prefill faster than any load, LMCache is told to recompute a stored chunk (and the
    daemon counts the hit it held back); deleting it still finds it stored."""
    daemon = daemon_factory("--prefill-tokens-per-s", "1e9")
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket, usage_refresh_s=0.0))
    try:
        ks = keys(3)
        assert store(adapter, ks, payload_objs(3, SIZE)).is_successful()
        assert lookup_and_lock(adapter, ks) == [False] * 3
        adapter.submit_unlock(ks)
        assert adapter.get_usage().total_bytes_used == 3 * SIZE
        adapter.delete(ks[:1])
        assert adapter.get_usage().total_bytes_used == 2 * SIZE
    finally:
        adapter.close()
    with Client(daemon.socket) as client:
        tenants = client.stats()["metrics"]["tenants"]
    assert sum(t.get("loads_skipped", 0) for t in tenants.values()) >= 3


def test_delete_list_and_usage_are_the_daemons_accounting(daemon: Daemon) -> None:
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket, usage_refresh_s=0.0))
    try:
        plain, salted = keys(5), keys(3, start=50, salt="alice", rank=3)
        assert store(adapter, plain, payload_objs(5, SIZE)).is_successful()
        assert store(adapter, salted, payload_objs(3, 2 * SIZE)).is_successful()
        usage = adapter.get_usage()
        assert dict(usage.bytes_by_cache_salt) == {"": 5 * SIZE, "alice": 6 * SIZE}
        assert usage.total_bytes_used == 11 * SIZE and usage.usage_fraction == -1.0

        def listed(model: str | None = None) -> dict[Any, int]:
            found: dict[Any, int] = {}
            cursor = None
            while True:
                page = adapter.list_l2_keys(model_name=model, page_size=3, cursor=cursor)
                assert len(page.entries) <= 3
                for entry in page.entries:
                    assert entry.key.to_object_key() not in found  # never listed twice
                    found[entry.key.to_object_key()] = entry.size_bytes
                if page.next_page_token is None:
                    return found
                cursor = page.next_page_token

        assert listed() == {**dict.fromkeys(plain, SIZE), **dict.fromkeys(salted, 2 * SIZE)}
        assert listed("other/model") == {}
        adapter.delete(plain[:2] + salted[2:] + keys(1, start=99))
        assert listed() == {**dict.fromkeys(plain[2:], SIZE), **dict.fromkeys(salted[:2], 2 * SIZE)}
        assert dict(adapter.get_usage().bytes_by_cache_salt) == {"": 3 * SIZE, "alice": 4 * SIZE}
        assert lookup_and_lock(adapter, plain + salted) == [False] * 2 + [True] * 5 + [False]
        adapter.submit_unlock(plain + salted)
    finally:
        adapter.close()


def test_the_daemon_away_is_misses_and_failed_stores_until_it_returns(
    daemon: Daemon,
) -> None:
    daemon.stop()
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket, reconnect_s=0.05, timeout_s=2.0))
    try:
        ks, objs = keys(2), payload_objs(2, SIZE, seed=4)
        assert not store(adapter, ks, objs).is_successful()
        assert lookup_and_lock(adapter, ks) == [False, False]
        assert loaded_bytes(adapter, ks)[0] == [False, False]
        daemon.start()
        deadline = 200
        while not store(adapter, ks, objs).is_successful() and deadline:
            deadline -= 1  # the adapter connects again after reconnect_s
        assert deadline
        assert loaded_bytes(adapter, ks) == ([True, True], [bytes(o.byte_array) for o in objs])
        daemon.restart()  # a lost connection: the next calls reconnect
        deadline = 200
        while lookup_and_lock(adapter, ks) != [True, True] and deadline:
            deadline -= 1
        assert deadline
        adapter.submit_unlock(ks)
    finally:
        adapter.close()


def test_two_controller_threads_at_once(daemon: Daemon) -> None:
    """LMCache's store and prefetch controllers call from two threads: every byte checked."""
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    errors: list[BaseException] = []
    ready = keys(8, start=1000)
    ready_objs = payload_objs(8, SIZE, seed=5)
    assert store(adapter, ready, ready_objs).is_successful()

    def storing() -> None:
        try:
            for round_ in range(10):
                ks = keys(4, start=2000 + 4 * round_)
                assert store(adapter, ks, payload_objs(4, SIZE, seed=round_)).is_successful()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def fetching() -> None:
        try:
            for _ in range(10):
                assert lookup_and_lock(adapter, ready) == [True] * 8
                bits, got = loaded_bytes(adapter, ready)
                adapter.submit_unlock(ready)
                assert bits == [True] * 8 and got == [bytes(o.byte_array) for o in ready_objs]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        threads = [threading.Thread(target=storing), threading.Thread(target=fetching)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
    finally:
        adapter.close()


class _GatedObject:
    """A memory object whose bytes can be reached only once `gate()` has returned (a load
    reaches them through `byte_array` to write them); all else is the wrapped object's."""

    def __init__(self, obj: Any, gate: Callable[[], None]) -> None:
        self._obj, self._gate = obj, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obj, name)

    @property
    def byte_array(self) -> memoryview:
        self._gate()
        view: memoryview = self._obj.byte_array
        return view


def test_a_key_loads_while_the_one_before_is_copied_into_its_object(daemon: Daemon) -> None:
    """The daemon reads the next key while the adapter copies the last one out of its region:
    the first object's copy waits until the daemon has served the second key's load, and both
    arrive whole."""
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    ks, objs = keys(3, start=3000), payload_objs(3, SIZE, seed=6)
    with Client(daemon.socket) as probe:
        try:
            assert store(adapter, ks, objs).is_successful()
            served = probe.stats()["store"]["loaded_blocks"]

            def second_key_served() -> None:
                wait_for(
                    lambda: probe.stats()["store"]["loaded_blocks"] >= served + 2,
                    "the second key loaded while the first one's copy waited",
                    timeout=DEADLINE_S / 2,
                )

            outs = [memory_obj(SIZE, fill=0) for _ in ks]
            gated = [_GatedObject(outs[0], second_key_served), *outs[1:]]
            assert load(adapter, ks, gated) == [True] * 3
            assert [bytes(o.byte_array) for o in outs] == [bytes(o.byte_array) for o in objs]
        finally:
            adapter.close()


@pytest.mark.parametrize("lanes", [1, 3])
def test_a_load_task_loads_every_key_whatever_its_lanes(daemon: Daemon, lanes: int) -> None:
    """A task of more keys than lanes loads every key whole, on one lane as on several."""
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket, load_lanes=lanes))
    ks, objs = keys(7, start=3100 + 10 * lanes), payload_objs(7, SIZE, seed=lanes)
    try:
        assert store(adapter, ks, objs).is_successful()
        assert loaded_bytes(adapter, ks) == ([True] * 7, [bytes(o.byte_array) for o in objs])
        assert len(adapter.report_status()["load_links"]) == lanes - 1
    finally:
        adapter.close()


def test_the_next_key_loads_and_is_copied_while_a_copy_waits(daemon: Daemon) -> None:
    """A task's keys are dealt to two lanes (the default), each with its own connection: the
    second key is loaded and copied into its object while the first one's copy is held up."""
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    ks, objs = keys(2, start=3200), payload_objs(2, SIZE, seed=9)
    try:
        assert store(adapter, ks, objs).is_successful()
        outs = [memory_obj(SIZE, fill=0) for _ in ks]
        second = bytes(objs[1].byte_array)

        def second_key_copied() -> None:
            wait_for(
                lambda: bytes(outs[1].byte_array) == second,
                "the second key copied while the first one's copy waited",
                timeout=DEADLINE_S / 2,
            )

        assert load(adapter, ks, [_GatedObject(outs[0], second_key_copied), outs[1]]) == [True] * 2
        assert [bytes(o.byte_array) for o in outs] == [bytes(o.byte_array) for o in objs]
    finally:
        adapter.close()


def test_a_task_with_a_failed_lane_ends_only_after_every_other_lane(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane that fails (its memory object cannot be written) fails the task, but only once the
    other lanes are done: nothing is copied into a memory object after LMCache has the result.
    The second lane's copy waits until the task waits on its lanes, or has ended."""
    l2 = PrefixdL2Adapter(adapter_params(daemon.socket))
    ks, objs = keys(2, start=3300), payload_objs(2, SIZE, seed=10)
    outs = [memory_obj(SIZE, fill=0) for _ in ks]
    waiting, finished = threading.Event(), threading.Event()
    second_at_finish: list[bytes] = []
    real_wait, real_finish = adapter.wait, l2._finish

    def wait(lanes: Any) -> Any:
        waiting.set()
        return real_wait(lanes)

    def finish(task: Any, result: Any) -> None:
        if task.kind == "load":
            second_at_finish.append(bytes(outs[1].byte_array))
            finished.set()
        real_finish(task, result)

    def unwritable() -> None:
        raise RuntimeError("this memory object cannot be written")

    def task_waits_or_ended() -> None:
        wait_for(lambda: waiting.is_set() or finished.is_set(), "the load task waits or ended")

    monkeypatch.setattr(adapter, "wait", wait)
    monkeypatch.setattr(l2, "_finish", finish)
    try:
        assert store(l2, ks, objs).is_successful()
        gated = [_GatedObject(outs[0], unwritable), _GatedObject(outs[1], task_waits_or_ended)]
        assert load(l2, ks, gated) == [False, False]
        assert second_at_finish == [bytes(objs[1].byte_array)]
    finally:
        l2.close()


def test_an_object_larger_than_the_region_is_a_miss_reported_with_its_fix(daemon: Daemon) -> None:
    """A stored object that cannot fit this adapter's region (stored by one with a larger
    region) is a miss the adapter reports, with the fix, in its status: never a silent one."""
    size = 2 << 20
    ks, objs = keys(1, start=4000), payload_objs(1, size, seed=7)
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        assert store(adapter, ks, objs).is_successful()
    finally:
        adapter.close()
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket, region_bytes=1 << 20))
    try:
        assert lookup_and_lock(adapter, ks, uint8_layout(size)) == [True]
        outs = [memory_obj(size, fill=0xEE)]
        assert load(adapter, ks, outs) == [False]
        assert bytes(outs[0].byte_array) == b"\xee" * size
        problem = adapter.report_status()["prefetch_link"]["last_problem"]
        assert problem is not None and problem["kind"] == "region", problem
        assert "region_bytes" in problem["fix"]
        adapter.submit_unlock(ks)
    finally:
        adapter.close()


def test_an_object_of_another_dtype_or_shape_is_a_miss_never_its_bytes(daemon: Daemon) -> None:
    """An engine restarted with another KV dtype (bfloat16 to float16: the same bytes per chunk)
    or layout asks for the same keys: LMCache's keys do not say the dtype, its memory objects and
    layout descriptions do. Each layout reads its own bytes back, and never another's."""
    import dataclasses

    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    shape = torch.Size([2, 2, 64, 96])
    layouts = {
        "bf16": (shape, torch.bfloat16),
        "fp16": (shape, torch.float16),
        "permuted": (torch.Size([2, 2, 96, 64]), torch.bfloat16),
    }
    ks = keys(3, start=40)
    first = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        objs = [typed_obj(*layouts["bf16"], seed=i) for i in range(3)]
        assert store(first, ks, objs).is_successful()
    finally:
        first.close()
    stored = [bytes(o.byte_array) for o in objs]
    restarted = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        for name, (shape_, dtype) in layouts.items():
            desc = {0: MemoryLayoutDesc(shapes=[shape_], dtypes=[dtype])}
            found = lookup_and_lock(restarted, ks, desc)
            restarted.submit_unlock([k for k, hit in zip(ks, found) if hit])
            outs = [typed_obj(shape_, dtype, seed=100 + i) for i in range(3)]
            bits = load(restarted, ks, outs)
            got = [bytes(o.byte_array) for o in outs]
            if name == "bf16":
                assert found == bits == [True] * 3 and got == stored
            else:
                assert found == bits == [False] * 3, name
                assert all(g != s for g, s in zip(got, stored))
        # a lookup with no layout, for a group this adapter has never seen, finds nothing, and
        # says so in its status
        other_model = [dataclasses.replace(k, model_name="other/model") for k in ks]
        assert lookup_and_lock(restarted, other_model) == [False] * 3
        assert restarted.report_status()["keys_without_layout"] == 3
        # another object group of the same keys has a layout of its own
        other_group = [dataclasses.replace(k, object_group_id=1) for k in ks]
        desc = {1: MemoryLayoutDesc(shapes=[shape], dtypes=[torch.bfloat16])}
        assert lookup_and_lock(restarted, other_group, desc) == [False] * 3
        # an unlock releases the pin in the layout its lookup took it in, whatever was stored
        # since (the lookups after it run after it: one worker takes both in turn)
        bf16 = {0: MemoryLayoutDesc(shapes=[shape], dtypes=[torch.bfloat16])}
        assert lookup_and_lock(restarted, ks[:1], bf16) == [True]
        assert store(restarted, ks[:1], [typed_obj(shape, torch.float16, seed=7)]).is_successful()
        restarted.submit_unlock(ks[:1])
        assert lookup_and_lock(restarted, keys(1, start=999), bf16) == [False]
        identity, words = restarted._named(ks[0], layout_of([shape], [torch.bfloat16]))
        assert identity is not None
        assert restarted._fetcher.call(lambda c: c.unpin(identity, [words])) == 0
    finally:
        restarted.close()


def test_an_object_of_many_tensors_is_named_by_its_layouts_digest(daemon: Daemon) -> None:
    """An object of many tensors (one per layer, say) has a layout longer than an identity field
    holds: it is named by the layout's digest, and stores, looks up and loads as any other."""
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    shapes, dtypes = [torch.Size([2, 16])] * 400, [torch.bfloat16] * 400

    def many_tensors(seed: int | None = None) -> Any:
        obj = typed_obj(torch.Size([400 * 2 * 16]), torch.bfloat16, seed=seed)
        obj.meta.shapes, obj.meta.dtypes = list(shapes), list(dtypes)
        return obj

    ks = keys(2, start=60)
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        objs = [many_tensors(seed=i) for i in range(2)]
        assert store(adapter, ks, objs).is_successful()
        desc = {0: MemoryLayoutDesc(shapes=list(shapes), dtypes=list(dtypes))}
        assert lookup_and_lock(adapter, ks, desc) == [True, True]
        outs = [many_tensors(seed=10 + i) for i in range(2)]
        assert load(adapter, ks, outs) == [True, True]
        adapter.submit_unlock(ks)
        assert [bytes(o.byte_array) for o in outs] == [bytes(o.byte_array) for o in objs]
    finally:
        adapter.close()
