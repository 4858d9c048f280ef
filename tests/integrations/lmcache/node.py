"""LMCache's node server (`lmcache server`) with prefixd's L2 adapter, and LMCache's own
`lmcache bench server` / `lmcache bench l2` drivers against it, each in a process of its own.
Test-only."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixd.integrations.lmcache import l2_adapter_config

from ...waiting import wait_for

REPO = Path(__file__).resolve().parents[3]
LMCACHE = str(Path(sys.executable).with_name("lmcache"))
START_S = 240.0  # a node server starts in about 10 s here; generous for a busy machine
RUN_S = 300.0
# Small KV (4 layers, 2 chunks of 256 tokens a request: 4 MiB objects); 128 blocks, so that each
# of 3 requests reads other blocks of the (seeded) KV buffer: no two stored payloads are alike
KV_SPEC = "(2,128,16,8,128):float16:4"
_CHECKSUM = re.compile(r"\[seq (\d+)/(cold|warm)\] CHECKSUM: ([0-9a-f]+)")
_LOOKUP = re.compile(r"\[seq (\d+)/(cold|warm)\] LOOKUP: (\d+)/(\d+) chunks hit")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LMCACHE_DISABLE_BANNER": "1",
        "PYTHONWARNINGS": "ignore",
    }


def plugin_json(socket_path: Path, **params: Any) -> str:
    """The `--l2-adapter` JSON; a fixed weights identity unless `weights_from` is given."""
    if "weights_from" not in params:
        params.setdefault("weights", "sha256:node-test")
    return json.dumps(l2_adapter_config(str(socket_path), **params))


@dataclass
class BenchRun:
    """What `lmcache bench server` printed: per sequence, the digests of the chunks' checksums
    (cold: what was stored, warm: what was retrieved) and the chunks each lookup hit."""

    output: str
    checksums: dict[tuple[int, str], str] = field(default_factory=dict)
    hits: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)

    @property
    def story(self) -> str:
        """The per-request lines (what a failed assertion shows)."""
        return "\n".join(line for line in self.output.splitlines() if "seq" in line)

    @classmethod
    def parse(cls, output: str) -> BenchRun:
        run = cls(output)
        for seq, kind, digest in _CHECKSUM.findall(output):
            run.checksums[(int(seq), kind)] = digest
        for seq, kind, hit, total in _LOOKUP.findall(output):
            run.hits[(int(seq), kind)] = (int(hit), int(total))
        return run


class NodeServer:
    """`lmcache server` on free ports with prefixd's adapter; `stop` sends SIGINT, as Ctrl-C."""

    def __init__(self, workdir: Path, adapter_json: str) -> None:
        self.workdir = workdir
        self.adapter_json = adapter_json
        self.port = free_port()
        self.http_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"server-{self.starts}.log"

    def start(self, *extra: str) -> NodeServer:
        self.starts += 1
        command = [
            LMCACHE, "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--disable-observability",
            "--l2-adapter", self.adapter_json, *extra,
        ]  # fmt: skip
        log = open(self.log_path, "wb")  # noqa: SIM115 - the server's log, closed when it stops
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env())
        log.close()
        proc = self.proc

        def serving() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"lmcache server exited:\n{self.log()[-4000:]}")
            return b"Uvicorn running" in self.log_path.read_bytes()

        wait_for(serving, "lmcache server serving", timeout=START_S)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def bench(self, start: int, end: int) -> BenchRun:
        """LMCache's server bench: per sequence, a cold request (lookup, store what missed,
        checksums of it) and a warm one (lookup, zeroed destination, retrieve, checksums); its
        default pause between them (with none, a warm lookup can race the cold store)."""
        command = [
            LMCACHE, "bench", "server", "--rpc-url", self.rpc_url,
            "--url", f"http://127.0.0.1:{self.http_port}", "--mode", "cpu",
            "--transfer-mode", "lmcache_driven", "--kvcache-shape-spec", KV_SPEC,
            "--num-blocks", "128", "--num-tokens", "512", "--start", str(start),
            "--end", str(end), "--interval", "0.5",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, env=env(), timeout=RUN_S, check=False)
        output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        assert done.returncode == 0, output[-4000:]
        return BenchRun.parse(output)

    def close(self) -> None:
        self.stop()


def bench_l2(adapter_json: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """`lmcache bench l2` with the adapter, verifying every loaded byte."""
    command = [
        LMCACHE, "bench", "l2", "--l2-adapter", adapter_json, "--lookup-max-hit-rate", "1.0",
        "--no-skip-verify", "--format", "json", *extra,
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, env=env(), timeout=RUN_S, check=False
    )
