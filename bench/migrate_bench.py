"""How long `prefixd migrate up` takes per GiB of store.

Writes a store of `--size-mib` of payloads in blocks of `--block-kib`, turns it into what schema
version 1 wrote (16-byte access records become 8-byte ones, the per-identity byte counters go),
times the migration to the current version, and checks the store afterwards. The steps touch one
small record per block and never a payload, so the cost follows the number of blocks, not the bytes:
the JSON gives both.

    python bench/migrate_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import struct
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from prefixd import Identity, Store
from prefixd.migrate import Migrator
from prefixd.schema.meta import StoreMeta, with_version
from prefixd.schema.records import AccessRecord

V1_ACCESS = struct.Struct("<Q")


def write_store(path: Path, size_mib: int, block_kib: int) -> int:
    identity = Identity(
        model="bench",
        weights="w",
        tokenizer="t",
        template="c",
        rope="r",
        kv_layout="bf16",
        block_tokens=256,
        tenant="bench",
    )
    n_blocks = size_mib * 1024 // block_kib
    payload = np.random.default_rng(0).integers(0, 256, block_kib << 10, dtype=np.uint8).tobytes()
    tokens = np.arange(n_blocks * 256, dtype=np.uint32)
    with Store.open(path, map_size=(2 * size_mib + 256) << 20) as store:
        for start in range(0, n_blocks, 64):
            count = min(64, n_blocks - start)
            store.put(identity, tokens, [payload] * count, first_block=start)
    return n_blocks


def as_version_1(path: Path) -> None:
    env = lmdb.open(str(path), max_dbs=16)
    meta_db, access = env.open_db(b"meta"), env.open_db(b"access")
    with env.begin(write=True) as txn:
        for key, value in list(txn.cursor(db=access)):
            txn.put(bytes(key), V1_ACCESS.pack(AccessRecord.decode(value).last_ns), db=access)
        counters_db = env.open_db(b"counters", txn=txn)
        for key in [bytes(k) for k in txn.cursor(db=counters_db).iternext(values=False)]:
            if key.startswith(b"identity_stored:"):
                txn.delete(key, db=counters_db)
        meta = StoreMeta.decode(txn.get(b"meta", db=meta_db))
        txn.put(b"meta", with_version(meta, 1).encode(), db=meta_db)
    env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prefixd-migrate-", dir=args.dir))
    try:
        path = work / "store"
        n_blocks = write_store(path, args.size_mib, args.block_kib)
        as_version_1(path)
        started = time.perf_counter()
        report = Migrator(path).upgrade()
        seconds = time.perf_counter() - started
        with Store.open(path, create=False) as store:
            problems = store.check(verify_payloads=False)
            assert not problems, problems
        result = {
            "size_mib": args.size_mib,
            "blocks": n_blocks,
            "seconds": round(seconds, 4),
            "seconds_per_gib": round(seconds * 1024 / args.size_mib, 4),
            "us_per_block": round(seconds / n_blocks * 1e6, 2),
            "steps": [
                {"to": step.version, "changed": step.changed, "seconds": step.seconds}
                for step in report.steps
            ],
            "problems": len(problems),
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")


if __name__ == "__main__":
    main()
