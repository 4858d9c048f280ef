"""Group commit (prefixd.store.commits): puts that arrive while another commits share one write
transaction, and every put's outcome is exactly what it would have been alone."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd import Identity, Store
from prefixd.errors import OrphanBlockError, PutRefusedError
from tests.daemon.conftest import make_identity
from tests.store.test_journal import View, inventory
from tests.waiting import wait_for


@contextmanager
def queued_behind_a_commit(store: Store, n_puts: int) -> Iterator[Callable[[], None]]:
    """Hold the turn to commit, as a put that is committing does, so that the puts started
    inside the block queue up; `release()` once `n_puts` are queued lets them all commit."""
    commits = store._writer._commits
    held = commits.held()
    held.__enter__()
    released = False

    def release() -> None:
        nonlocal released
        wait_for(lambda: commits.waiting >= n_puts, f"{n_puts} queued puts")
        held.__exit__(None, None, None)
        released = True

    try:
        yield release
    finally:
        if not released:
            held.__exit__(None, None, None)


def put_in_threads(store: Store, puts: list[Callable[[], object]]) -> list[object]:
    """Start every put on a thread of its own, let them queue, commit them; their results
    (or the errors they raised), in order."""
    results: list[object] = [None] * len(puts)

    def run(i: int) -> None:
        try:
            results[i] = puts[i]()
        except Exception as exc:  # noqa: BLE001 - the test compares errors too
            results[i] = exc

    commits = store._writer._commits
    with queued_behind_a_commit(store, len(puts)) as release:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(puts))]
        for i, thread in enumerate(threads):  # one by one, so they queue in this order
            thread.start()
            wait_for(lambda i=i: commits.waiting > i, f"put {i} queued")
        release()
        for thread in threads:
            thread.join()
    return results


def test_puts_queued_behind_a_commit_share_one_transaction(
    store: Store, identity: Identity
) -> None:
    view = View()
    store.observe(view)
    prompts = [[1000 * i + t for t in range(8)] for i in range(8)]
    payloads = [[bytes([i]) * 64, bytes([i + 100]) * 64] for i in range(8)]
    puts = [(lambda i=i: store.put(identity, prompts[i], payloads[i])) for i in range(8)]
    results = put_in_threads(store, puts)
    assert [r.stored for r in results] == [2] * 8  # type: ignore[attr-defined]
    assert store._writer._commits.groups == 1  # one transaction, one commit, for all eight
    for i in range(8):
        out = bytearray(128)
        assert store.load(identity, prompts[i], out).n_blocks == 2
        assert bytes(out) == b"".join(payloads[i])
    assert view.blocks.keys() == inventory(store).keys() and len(view.blocks) == 16


def test_a_refused_put_in_a_group_leaves_the_others_stored(
    store: Store, identity: Identity
) -> None:
    view = View()
    store.observe(view)
    store.put(identity, [9, 9, 9, 9], [b"owner" * 10])
    orphan = list(range(500, 512))
    puts: list[Callable[[], object]] = [
        lambda: store.put(identity, [1, 2, 3, 4], [b"a" * 64]),
        lambda: store.put(identity, orphan, [b"o" * 64], first_block=2),  # blocks 0, 1 absent
        lambda: store.put(identity, [5, 6, 7, 8], [b"b" * 64]),
    ]
    first, refused, last = put_in_threads(store, puts)
    assert isinstance(refused, OrphanBlockError)
    assert first.stored == 1 and last.stored == 1  # type: ignore[attr-defined]
    assert store.longest_prefix(identity, orphan).n_blocks == 0
    assert store.check() == []
    assert view.blocks.keys() == inventory(store).keys() and len(view.blocks) == 3


def test_a_put_in_a_group_sees_the_blocks_an_earlier_one_wrote(
    store: Store, identity: Identity
) -> None:
    prompt = list(range(40))
    puts: list[Callable[[], object]] = [
        lambda: store.put(identity, prompt[:16], [b"x" * 64] * 4),
        lambda: store.put(identity, prompt, [b"y" * 64] * 6, first_block=4),
    ]
    results = put_in_threads(store, puts)
    # queued in that order, so the second extends the first (never refused as an orphan)
    assert [r.stored for r in results] == [4, 6]  # type: ignore[attr-defined]
    assert store.longest_prefix(identity, prompt).n_blocks == 10


Put = tuple[int, int, int]  # (prompt, first block, blocks): of a few prompts sharing blocks


IDENTITY = make_identity()  # the conftest's identity, for hypothesis (no fixtures there)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 3)), min_size=2, max_size=8
    )
)
def test_grouped_puts_end_as_the_same_puts_one_at_a_time(plan: list[Put]) -> None:
    identity = IDENTITY
    prompts = [
        list(range(24)),
        list(range(8)) + list(range(100, 116)),  # shares blocks 0-1 with prompt 0
        list(range(200, 224)),
        [7] * 24,
    ]

    def payloads(prompt: int, first: int, n: int) -> list[bytes]:
        return [bytes([prompt * 16 + first + k]) * 32 for k in range(n)]

    def outcome(result: object) -> object:
        if isinstance(result, PutRefusedError):
            return type(result)
        return (result.stored, result.existed)  # type: ignore[attr-defined]

    with tempfile.TemporaryDirectory(prefix="commits-") as tmp:  # one per example, removed
        root = Path(tmp)
        with Store.open(root / "alone", map_size=64 << 20) as alone:
            expected = []
            for p, first, n in plan:
                try:
                    expected.append(
                        outcome(
                            alone.put(
                                identity, prompts[p], payloads(p, first, n), first_block=first
                            )
                        )
                    )
                except PutRefusedError as exc:
                    expected.append(type(exc))
            alone_view = inventory(alone)
        with Store.open(root / "grouped", map_size=64 << 20) as grouped:
            puts = [
                (
                    lambda p=p, first=first, n=n: grouped.put(
                        identity, prompts[p], payloads(p, first, n), first_block=first
                    )
                )
                for p, first, n in plan
            ]
            got = [outcome(r) for r in put_in_threads(grouped, puts)]
            assert got == expected
            assert inventory(grouped).keys() == alone_view.keys()
            assert grouped.check() == []
