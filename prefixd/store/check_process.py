"""Checking a store in a child process: LMDB's assertions may abort the process that walks a damaged
page, and a daemon must survive its own `verify`. The child prints progress on stderr and the
problems as JSON on stdout."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixd.store.results import Problem

_PROGRESS = "progress "


def run_check(
    path: Path, *, verify_payloads: bool = True, progress: Callable[[int], None] | None = None
) -> list[Problem]:
    """What `Store.check` would list, found by a child; a child killed by the damage is itself a
    problem (kind "pages")."""
    command = [sys.executable, "-m", "prefixd.store.check_process", str(path)]
    if not verify_payloads:
        command.append("--no-payloads")
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert child.stdout is not None and child.stderr is not None
    errors = []
    for line in child.stderr:
        if line.startswith(_PROGRESS):
            if progress is not None:
                progress(int(line[len(_PROGRESS) :]))
        else:
            errors.append(line)
    out = child.stdout.read()
    code = child.wait()
    if code == 0:
        return [
            Problem(p["kind"], p["detail"], bytes.fromhex(p["block"]) if p["block"] else None)
            for p in json.loads(out)
        ]
    how = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    last = errors[-1].strip() if errors else ""
    return [
        Problem(
            "pages",
            f"the check {how} reading the store ({last[-200:]}): LMDB pages are damaged beyond "
            "what a repair can mend; restore the store from a backup, or delete it and let the "
            "cache refill",
        )
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from prefixd.store.check import check_store
    from prefixd.store.config import StoreConfig
    from prefixd.store.environment import open_environment

    parser = argparse.ArgumentParser(
        prog="python -m prefixd.store.check_process", allow_abbrev=False
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("--no-payloads", action="store_true")
    args = parser.parse_args(argv)

    def report(n: int) -> None:
        print(f"{_PROGRESS}{n}", file=sys.stderr, flush=True)

    env, tables, _meta = open_environment(StoreConfig(path=args.path, create=False), readonly=True)
    try:
        with env.begin(buffers=True) as txn:
            problems = check_store(
                txn, tables, verify_payloads=not args.no_payloads, progress=report
            )
    finally:
        env.close()
    listed = [
        {"kind": p.kind, "detail": p.detail, "block": p.block.hex() if p.block else ""}
        for p in problems
    ]
    print(json.dumps(listed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
