"""The caches prefixd is compared with, as a naive engine cache would use them: every closed block
under a key derived from its chain hash (`BlockChain(identity, tokens).hash(i)`).

* lookup: derive the keys, probe them block by block until the first miss.
* load:   fetch the hit blocks' bytes (redis: one MGET; diskcache: one get per block) and copy them
          into a preallocated destination buffer (the copy is timed: prefixd's load writes into the
          client's region, so it pays its copy too).
* put:    set the missing blocks (redis: one pipeline; diskcache: one set per block).

Redis is Debian's `redis-server`, started here on a Unix socket in a temporary directory with
append-only persistence (`--appendfsync everysec`), no RDB snapshots. diskcache is a
`diskcache.Cache` on a temporary directory (size limit raised so that it never evicts: hits are then
the same as prefixd's on the unbounded workloads).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from prefixd import Identity
from prefixd.schema.chain import BlockChain

KEY_PREFIX = b"kv:"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


class _ChainKeys:
    """The keys of the current request's blocks, derived once per request (at lookup)."""

    def __init__(self) -> None:
        self.chain: BlockChain | None = None

    def derive(self, ident: Identity, prompt: np.ndarray) -> BlockChain:
        self.chain = BlockChain(ident, prompt)
        return self.chain

    def key(self, index: int) -> bytes:
        assert self.chain is not None
        return KEY_PREFIX + self.chain.hash(index)


class _Destination:
    """A preallocated, already touched buffer the loaded payloads are copied into."""

    def __init__(self, size: int) -> None:
        self.buffer = np.empty(size, dtype=np.uint8)
        self.buffer.fill(0xA5)

    def place(self, values: Sequence[bytes | None]) -> list[np.ndarray]:
        views, offset = [], 0
        for value in values:
            if value is None:
                break
            data = np.frombuffer(value, dtype=np.uint8)
            view = self.buffer[offset : offset + data.size]
            np.copyto(view, data)
            views.append(view)
            offset += data.size
        return views


# --- redis -----------------------------------------------------------------------------------


def redis_unavailable() -> str | None:
    """Why the redis peer cannot run here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (Debian: apt-get install redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis Python client is not installed (pip install redis)"
    return None


class RedisServer:
    """`redis-server` on a Unix socket (no TCP port) in `workdir`, append-only, fsync every second."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.socket = workdir / "redis.sock"
        self.log_path = workdir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0

    def command(self) -> list[str]:
        return [
            "redis-server",
            "--port",
            "0",
            "--unixsocket",
            str(self.socket),
            "--unixsocketperm",
            "700",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--daemonize",
            "no",
        ]

    def start(self) -> None:
        import redis

        started = time.perf_counter()
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
            )
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}{self.tail()}"
                )
            if time.perf_counter() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"redis-server did not answer within {READY_TIMEOUT_S}s")
            if self.socket.exists():
                try:
                    with redis.Redis(unix_socket_path=str(self.socket)) as probe:
                        if probe.ping():
                            break
                except redis.exceptions.ConnectionError:
                    pass
            time.sleep(0.01)
        self.start_s = time.perf_counter() - started

    def client(self) -> Any:
        import redis

        return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=300)

    def info(self) -> dict[str, Any]:
        with self.client() as client:
            info = client.info()
        return {
            "version": info.get("redis_version"),
            "used_memory": info.get("used_memory"),
            "aof_enabled": info.get("aof_enabled"),
        }

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def tail(self, limit: int = 2000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"; its log ends:\n{text[-limit:]}" if text else ""

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class RedisBackend:
    name = "redis"

    def __init__(self, client: Any, destination_bytes: int) -> None:
        self.client = client
        self.keys = _ChainKeys()
        self.dest = _Destination(destination_bytes)

    def lookup(self, ident: Identity, prompt: np.ndarray) -> int:
        chain = self.keys.derive(ident, prompt)
        exists = self.client.exists
        n = 0
        while n < chain.n_blocks and exists(self.keys.key(n)):
            n += 1
        return n

    def load(self, ident: Identity, prompt: np.ndarray, n_blocks: int) -> Sequence[Any]:
        values = self.client.mget([self.keys.key(i) for i in range(n_blocks)])
        return self.dest.place(values)

    def put(
        self, ident: Identity, prompt: np.ndarray, first_block: int, payloads: Sequence[Any]
    ) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i, payload in enumerate(payloads):
            pipe.set(self.keys.key(first_block + i), memoryview(payload))
        pipe.execute()


# --- diskcache -------------------------------------------------------------------------------


def diskcache_unavailable() -> str | None:
    try:
        import diskcache  # noqa: F401
    except ImportError:
        return "diskcache is not installed (pip install diskcache)"
    return None


def open_diskcache(directory: Path) -> Any:
    import diskcache

    return diskcache.Cache(str(directory), size_limit=1 << 50)


class DiskcacheBackend:
    name = "diskcache"

    def __init__(self, cache: Any, destination_bytes: int) -> None:
        self.cache = cache
        self.keys = _ChainKeys()
        self.dest = _Destination(destination_bytes)

    def lookup(self, ident: Identity, prompt: np.ndarray) -> int:
        chain = self.keys.derive(ident, prompt)
        cache = self.cache
        n = 0
        while n < chain.n_blocks and self.keys.key(n) in cache:
            n += 1
        return n

    def load(self, ident: Identity, prompt: np.ndarray, n_blocks: int) -> Sequence[Any]:
        get = self.cache.get
        return self.dest.place([get(self.keys.key(i)) for i in range(n_blocks)])

    def put(
        self, ident: Identity, prompt: np.ndarray, first_block: int, payloads: Sequence[Any]
    ) -> None:
        for i, payload in enumerate(payloads):
            self.cache.set(self.keys.key(first_block + i), bytes(payload))


def versions() -> dict[str, str | None]:
    """Versions of the peers' Python packages and of redis-server, where installed."""
    found: dict[str, str | None] = {"redis_py": None, "diskcache": None, "redis_server": None}
    try:
        import redis

        found["redis_py"] = redis.__version__
    except ImportError:
        pass
    try:
        import diskcache

        found["diskcache"] = diskcache.__version__
    except ImportError:
        pass
    if shutil.which("redis-server"):
        out = subprocess.run(
            ["redis-server", "--version"], check=False, capture_output=True, text=True
        ).stdout
        found["redis_server"] = next((w[2:] for w in out.split() if w.startswith("v=")), out)
    return found
