"""A writer killed with SIGKILL at random moments, again and again: after every kill the store
checks clean, every acknowledged put is there byte for byte, and the put in flight is there
whole or not at all (never a partial block or a partial prompt)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from prefixd import Identity, Store

IDENT = Identity(
    model="m",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=4,
    tenant="a",
)
BASES = 4  # prompts share one of these 3-block beginnings
BASE_BLOCKS = 3
OWN_BLOCKS = 2
KILLS = 30

WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from tests.store.test_crash import IDENT, prompt, payloads
    from prefixd import Store
    from prefixd.store import write_behind

    write_behind.KICK_BYTES = 64 << 10  # the disk writes started every few puts, kills among them
    store = Store.open(sys.argv[1], map_size=256 << 20, verify_threads=0)
    i = int(sys.argv[2])
    print("ready", flush=True)
    while True:
        store.put(IDENT, prompt(i), payloads(i))
        print(i, flush=True)  # acknowledged: put returned
        i += 1
    """
)


def prompt(i: int) -> list[int]:
    base = [1_000_000 * (i % BASES + 1) + t for t in range(4 * BASE_BLOCKS)]
    return base + [2_000_000_000 + 4 * OWN_BLOCKS * i + t for t in range(4 * OWN_BLOCKS)]


def payloads(i: int) -> list[bytes]:
    """Block payloads derived from the blocks' tokens (shared blocks have shared payloads)."""
    tokens = prompt(i)
    return [
        random.Random(tokens[4 * b]).randbytes(3000 + 7 * (tokens[4 * b] % 97))
        for b in range(BASE_BLOCKS + OWN_BLOCKS)
    ]


def test_random_kills_lose_no_acknowledged_put(tmp_path: Path, long_run: bool) -> None:
    path = tmp_path / "s"
    script = tmp_path / "writer.py"
    repo = str(Path(__file__).resolve().parents[2])
    script.write_text(WRITER.format(repo=repo))
    rng = random.Random(7)
    kills = KILLS * (10 if long_run else 1)
    acknowledged: set[int] = set()
    next_i = 0
    survived = 0
    for _ in range(kills):
        with open(tmp_path / "stderr.txt", "w") as err:
            child = subprocess.Popen(
                [sys.executable, str(script), str(path), str(next_i)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            try:
                assert child.stdout.readline() == "ready\n", (tmp_path / "stderr.txt").read_text()
                # real time, on purpose: the writer is another process, and the kill must land
                # at a random moment of its puts (no clock of ours can move it)
                time.sleep(rng.uniform(0.0, 0.12))
                os.kill(child.pid, signal.SIGKILL)
                acks = [int(line) for line in child.stdout.read().split()]
            finally:
                child.kill()
                child.wait(timeout=30)
                child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        acknowledged.update(acks)
        in_flight = (acks[-1] + 1) if acks else next_i
        with Store.open(path, map_size=256 << 20, verify_threads=0) as store:
            assert store.check(verify_payloads=False) == []  # records, indexes, counters
            # the puts acknowledged just before the kill, and a sample of the older ones (all of
            # them are checked once more at the end)
            recent = sorted(acknowledged)[-20:]
            older = rng.sample(sorted(acknowledged), min(20, len(acknowledged)))
            for i in {*recent, *older}:
                assert_whole(store, i)
            found = store.longest_prefix(IDENT, prompt(in_flight)).n_blocks
            # the put in flight committed whole or not at all
            assert found in (0, BASE_BLOCKS, BASE_BLOCKS + OWN_BLOCKS), found
            if found == BASE_BLOCKS + OWN_BLOCKS:
                assert_whole(store, in_flight)
                acknowledged.add(in_flight)
                in_flight += 1
        next_i = in_flight
        survived += 1
    with Store.open(path, map_size=256 << 20, verify_threads=0) as store:
        assert store.check() == []  # every payload's checksum too
        for i in sorted(acknowledged):
            assert_whole(store, i)
    print(f"\nwriter kills survived: {survived}, acknowledged puts kept: {len(acknowledged)}")
    assert len(acknowledged) > kills // 2  # the writer made progress between kills


def assert_whole(store: Store, i: int) -> None:
    out = bytearray(64 << 10)
    loaded = store.load(IDENT, prompt(i), out)
    assert loaded.n_blocks == BASE_BLOCKS + OWN_BLOCKS, i
    got = [bytes(out[o : o + n]) for o, n in zip(loaded.offsets, loaded.sizes, strict=True)]
    assert got == payloads(i), i
