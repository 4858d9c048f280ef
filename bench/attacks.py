"""The hostile local peer's attacks on the request path, replayed against a daemon started with
its defaults, each beside an honest client: how the honest client fared (answers, errors, p50 /
p99 / max latency), how much the daemon's peak memory grew, and what the attacker was told.

* tokens:   3 peers, each sending lookups of one 64 Mi-id prompt through a token region.
* pipeline: 100,000 pipelined lookups never read, then a disconnect (and the first answer after).
* decode:   2 peers, each 6 put_state frames of 32 groups x 65,536 checkpoints (12 MiB) and 6
            frames of 16 million empty arrays in an unknown field.
* verify:   64 pipelined verifies of a store of 128 x 64 KiB blocks.
* purge:    64 pipelined dry-run purges of a store of 32,768 blocks.
* spans:    a put of 256 blocks whose spans all name one whole 1 MiB region.
* headers:  32 connections, each sending a header that claims the longest frame, and one byte.
* replies:  4 lookups never read, each of 4096 prompts naming one 4096-id span of a stored
            chain of one-token blocks (8 bytes of reply per hit block).
* unpin:    an unpin of a prompt of 4 Mi one-token blocks, one of them pinned.

`python bench/attacks.py --json` runs them all (`--only decode,verify` some); with the
revision under test on PYTHONPATH it measures that revision's daemon, so two revisions can be
compared on the same machine. Every attack is bounded by `--attack-timeout-s`: an attack the
daemon cannot shake off is reported as `timed_out`, never waited for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import msgpack
import numpy as np
from benchlib import bench_identity
from suitelib import SuiteDaemon, machine_info, percentiles_us

from prefixd.client import Client
from prefixd.wire.frames import HEADER, PROTOCOL_VERSION, encode_frame
from prefixd.wire.region import SharedRegion, send_with_fds

IDENTITY = bench_identity(block_tokens=16, payload_bytes=256)
BT = IDENTITY.block_tokens
ONE_TOKEN = bench_identity(block_tokens=1, payload_bytes=8)  # a block per token id
HONEST_PROMPT = np.arange(64 * BT, dtype=np.uint32) + 7


class Honest:
    """An honest client on its own thread, looking up and loading a stored 64-block prompt until
    stopped; each latency is one lookup and one load."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        with Client(self.socket_path, region_bytes=1 << 20, timeout=600) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:  # a lookup (answered on the daemon's loop) and a load (on its workers)
                    hit = client.lookup(IDENTITY, [HONEST_PROMPT])[0].n_blocks
                    with client.load(IDENTITY, HONEST_PROMPT) as loaded:
                        if hit != 64 or len(loaded.views) != 64:
                            self.errors.append("a short hit")
                except Exception as exc:  # noqa: BLE001 - every failure is what we report
                    self.errors.append(type(exc).__name__)
                self.latencies.append(time.perf_counter() - started)
                self._stop.wait(0.005)

    def report(self) -> dict[str, Any]:
        us = percentiles_us(self.latencies)
        return {
            "answered": len(self.latencies) - len(self.errors),
            "errors": len(self.errors),
            "p50_ms": round(us["p50"] / 1e3, 2),
            "p99_ms": round(us["p99"] / 1e3, 2),
            "max_ms": round(max(self.latencies, default=0.0) * 1e3, 2),
        }


class Raw:
    """A bare connection that frames requests by hand and reads replies' raw bodies."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.send({"op": "hello", "id": 1, "protocol": PROTOCOL_VERSION, "client": "attacker"})
        self.recv()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(message))

    def recv(self) -> dict[str, Any]:
        (length,) = HEADER.unpack(self._exact(HEADER.size))
        reply = msgpack.unpackb(self._exact(length), raw=False)
        assert isinstance(reply, dict)
        return reply

    def _exact(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            got = self.sock.recv(left)
            if not got:
                raise ConnectionError("closed")
            chunks.append(got)
            left -= len(got)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()


def _outcomes(replies: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for reply in replies:
        key = "ok" if reply.get("ok") else reply.get("error", {}).get("code", "?")
        counts[key] = counts.get(key, 0) + 1
    return counts


# --- the attacks: each returns what the attacker was told -----------------------------------


# Each attack is prepared (its frames built) before the honest client starts, then run: the
# attacker's own work in this process would otherwise be counted against the daemon.
Attack = Callable[[], dict[str, Any]]


def attack_tokens(daemon: SuiteDaemon, timeout: float) -> Attack:
    from prefixd.errors import TokenError

    prompt = np.zeros(64 << 20, dtype=np.uint32)
    told: dict[str, int] = {}
    seconds: list[float] = []

    def peer() -> None:
        with Client(
            daemon.socket, token_region_bytes=prompt.nbytes + (1 << 20), timeout=timeout
        ) as c:
            for _ in range(3):
                started = time.perf_counter()
                try:
                    c.lookup(IDENTITY, [prompt])
                    told["answered"] = told.get("answered", 0) + 1
                except TokenError:
                    told["bad_tokens"] = told.get("bad_tokens", 0) + 1
                seconds.append(time.perf_counter() - started)

    def go() -> dict[str, Any]:
        _all([peer] * 3, timeout)
        return {"told": told, "slowest_s": round(max(seconds, default=0.0), 4)}

    return go


def attack_pipeline(daemon: SuiteDaemon, timeout: float) -> Attack:
    frame = encode_frame(
        {"op": "lookup", "id": 7, "identity": IDENTITY.to_dict(),
         "prompts": [{"tokens": HONEST_PROMPT.tobytes()}]}
    )  # fmt: skip
    sent = [0]
    flood = Raw(daemon.socket, timeout)

    def pipeline() -> None:
        with contextlib.suppress(OSError):
            for _ in range(100_000):
                flood.sock.sendall(frame)
                sent[0] += 1

    def go() -> dict[str, Any]:
        sender = threading.Thread(target=pipeline, daemon=True)
        sender.start()
        sender.join(min(timeout, 5.0))  # the daemon reads what it serves: the sends block
        flood.sock.shutdown(socket.SHUT_RDWR)
        flood.close()
        sender.join(timeout)
        started = time.perf_counter()
        with Client(daemon.socket, timeout=timeout) as client:
            client.lookup(IDENTITY, [HONEST_PROMPT])
        return {
            "frames_sent": sent[0],
            "first_answer_after_disconnect_s": round(time.perf_counter() - started, 4),
        }

    return go


def attack_decode(daemon: SuiteDaemon, timeout: float) -> Attack:
    spans = encode_frame(
        {"op": "put_state", "id": 9, "identity": IDENTITY.to_dict(), "tokens": b"",
         "checkpoints": {f"g{i}": [[0, [0, 0, 0]]] * 65536 for i in range(32)}}
    )  # fmt: skip
    junk = encode_frame({"op": "health", "id": 10, "junk": [[]] * 16_000_000})
    replies: list[dict[str, Any]] = []

    def peer() -> None:
        conn = Raw(daemon.socket, timeout)
        try:
            for _ in range(6):
                conn.sock.sendall(spans)
                conn.sock.sendall(junk)
            replies.extend(conn.recv() for _ in range(12))
        finally:
            conn.close()

    def go() -> dict[str, Any]:
        _all([peer] * 2, timeout)
        return {"told": _outcomes(replies), "frame_mib": round(len(spans) / (1 << 20), 1)}

    return go


def _pipelined(
    daemon: SuiteDaemon, timeout: float, message: dict[str, Any], n: int
) -> dict[str, Any]:
    conn = Raw(daemon.socket, timeout)
    try:
        started = time.perf_counter()
        for rid in range(n):
            conn.send({**message, "id": 100 + rid})
        replies = [conn.recv() for _ in range(n)]
        return {
            "told": _outcomes(replies),
            "all_answered_s": round(time.perf_counter() - started, 3),
        }
    finally:
        conn.close()


def attack_verify(daemon: SuiteDaemon, timeout: float) -> Attack:
    return lambda: _pipelined(daemon, timeout, {"op": "verify"}, 64)


def attack_purge(daemon: SuiteDaemon, timeout: float) -> Attack:
    message = {"op": "purge", "everything": True, "dry_run": True}
    return lambda: _pipelined(daemon, timeout, message, 64)


def attack_spans(daemon: SuiteDaemon, timeout: float) -> Attack:
    region = SharedRegion(1 << 20)
    conn = Raw(daemon.socket, timeout)
    send_with_fds(
        conn.sock, encode_frame({"op": "attach", "id": 2, "size": region.size}), [region.fd]
    )
    rid = conn.recv()["region"]
    tokens = np.arange(256 * BT, dtype=np.uint32) + 50_000_000
    put = {"op": "put", "id": 3, "identity": IDENTITY.to_dict(), "tokens": tokens.tobytes(),
           "blocks": [[rid, 0, region.size]] * 256}  # fmt: skip

    def go() -> dict[str, Any]:
        try:
            before = _stored_bytes(daemon)
            conn.send(put)
            reply = conn.recv()
            return {"told": _outcomes([reply]), "stored_mib": _mib(_stored_bytes(daemon) - before)}
        finally:
            conn.close()
            region.close()

    return go


def attack_headers(daemon: SuiteDaemon, timeout: float) -> Attack:
    claimed = 16 << 20  # the default max_frame_bytes
    conns = [Raw(daemon.socket, timeout) for _ in range(32)]

    def go() -> dict[str, Any]:
        try:
            for conn in conns:
                conn.sock.sendall(HEADER.pack(claimed) + b"\x81")
            with Client(daemon.socket, timeout=timeout) as client:  # the headers came before
                client.health()
            return {"claimed_mib": _mib(32 * claimed)}  # held, or not: peak_rss_growth_mib
        finally:
            for conn in conns:
                conn.close()

    return go


def attack_replies(daemon: SuiteDaemon, timeout: float) -> Attack:
    region = SharedRegion(1 << 16)
    region.view[: 4 * 4096] = np.arange(4096, dtype=np.uint32).tobytes()
    conn = Raw(daemon.socket, timeout)
    attach = encode_frame({"op": "attach", "id": 2, "size": region.size})
    send_with_fds(conn.sock, attach, [region.fd])
    rid = conn.recv()["region"]
    lookup = {"op": "lookup", "id": 4, "identity": ONE_TOKEN.to_dict(), "stored_only": True,
              "prompts": [{"tokens_span": [rid, 0, 4096]}] * 4096}  # fmt: skip

    def go() -> dict[str, Any]:
        try:
            conn.send(lookup)
            (length,) = HEADER.unpack(conn._exact(HEADER.size))
            reply = msgpack.unpackb(conn._exact(length), raw=False)
            told = _outcomes([reply])
            return {
                "told": told,
                "frame_kib": len(encode_frame(lookup)) >> 10,
                "reply_mib": _mib(length),
            }
        finally:
            conn.close()
            region.close()

    return go


def attack_unpin(daemon: SuiteDaemon, timeout: float) -> Attack:
    prompt = np.arange(4 << 20, dtype=np.uint32)
    client = Client(daemon.socket, token_region_bytes=prompt.nbytes + (1 << 20), timeout=timeout)
    client.lookup(ONE_TOKEN, [prompt[:1]], pin=True, stored_only=True)

    def go() -> dict[str, Any]:
        try:
            started = time.perf_counter()
            released = client.unpin(ONE_TOKEN, [prompt])
            return {"released": released, "unpin_s": round(time.perf_counter() - started, 3)}
        finally:
            client.close()

    return go


def _stored_bytes(daemon: SuiteDaemon) -> int:
    with Client(daemon.socket) as client:
        return int(client.stats()["store"]["stored_bytes"])


def _mib(n: int) -> float:
    return round(n / (1 << 20), 1)


def _all(peers: Sequence[Callable[[], None]], timeout: float) -> None:
    threads = [threading.Thread(target=p, daemon=True) for p in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError


# --- the store each attack meets --------------------------------------------------------------


def _fill(daemon: SuiteDaemon, attack: str) -> None:
    with Client(daemon.socket, region_bytes=16 << 20, timeout=600) as client:
        client.put(IDENTITY, HONEST_PROMPT, [b"h" * 256] * 64)
        if attack in ("replies", "unpin"):
            client.put(ONE_TOKEN, np.arange(4096, dtype=np.uint32), [b"r" * 8] * 4096)
        if attack == "verify":
            prompt = np.arange(128 * BT, dtype=np.uint32) + 1_000_000
            client.put(IDENTITY, prompt, [bytes([i]) * (64 << 10) for i in range(128)])
        if attack == "purge":
            for k in range(4):
                prompt = np.arange(8192 * BT, dtype=np.uint32) + 2_000_000 + k * 1_000_000
                client.put(IDENTITY, prompt, [b"p" * 16] * 8192)


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    return 0


ATTACKS: dict[str, Callable[[SuiteDaemon, float], Attack]] = {
    "tokens": attack_tokens,
    "pipeline": attack_pipeline,
    "decode": attack_decode,
    "verify": attack_verify,
    "purge": attack_purge,
    "spans": attack_spans,
    "headers": attack_headers,
    "replies": attack_replies,
    "unpin": attack_unpin,
}


def run_attack(root: Path, name: str, timeout: float) -> dict[str, Any]:
    with SuiteDaemon(root, name) as daemon:
        _fill(daemon, name)
        attack = ATTACKS[name](daemon, timeout)
        before = _peak_rss(daemon.pid)
        with Honest(daemon.socket) as honest:
            time.sleep(0.2)  # the honest client's baseline before the attack
            started = time.perf_counter()
            try:
                outcome = attack()
            except (TimeoutError, OSError) as exc:
                outcome = {"timed_out": True, "error": type(exc).__name__}
            outcome["attack_s"] = round(time.perf_counter() - started, 3)
            time.sleep(0.2)
        outcome["honest"] = honest.report()
        # VmHWM counts the current RSS beside a high-water mark the kernel updates lazily, so a
        # reading can fall back a little once a peak at `before` is gone: growth is never below 0
        grown = max(0, _peak_rss(daemon.pid) - before)
        outcome["peak_rss_growth_mib"] = round(grown / (1 << 20), 1)
        return outcome


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(ATTACKS), help="attacks to run, comma-separated")
    parser.add_argument("--attack-timeout-s", type=float, default=120.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attacks: {', '.join(unknown)}")
    loadavg = os.getloadavg()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pd-attacks-") as root:
        for name in names:
            report[name] = run_attack(Path(root), name, args.attack_timeout_s)
    report["machine"] = machine_info(loadavg)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for name in names:
        row = dict(report[name])
        honest, grown, took = row.pop("honest"), row.pop("peak_rss_growth_mib"), row.pop("attack_s")
        print(f"{name:9} attack {took:8.3f} s  daemon peak +{grown:7.1f} MiB  honest {honest}")
        print(f"{'':9} attacker: {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
