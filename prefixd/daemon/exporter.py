"""Prometheus exposition of the daemon's metrics: a loopback HTTP port and/or a textfile for
node_exporter (renamed into place; without `process_*`, which node_exporter serves itself and
refuses as duplicates).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import Metric

from prefixd.errors import ServeError

log = logging.getLogger(__name__)


class MetricsExporter:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        port: int,
        address: str,
        textfile: Path | None,
        interval_s: float,
        textfile_mode: int = 0o640,
    ) -> None:
        self.registry = registry
        self.port = port
        self.address = address
        self.textfile = textfile
        self.interval_s = interval_s
        self.textfile_mode = textfile_mode
        self._http: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, pool: Executor) -> None:
        if self.port:
            try:
                self._http, _thread = start_http_server(self.port, self.address, self.registry)
            except OSError as exc:
                raise ServeError(
                    f"cannot serve metrics on {self.address}:{self.port}: {exc}"
                ) from None
            log.info("metrics on http://%s:%d/metrics", self.address, self.http_port)
        if self.textfile is not None:
            self.textfile.parent.mkdir(parents=True, exist_ok=True)
            self._task = asyncio.create_task(self._write_every(pool), name="prefixd-metrics")

    @property
    def http_port(self) -> int:
        """The port bound (the one chosen, for port 0)."""
        return int(self._http.server_address[1]) if self._http is not None else 0

    async def _write_every(self, pool: Executor) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(pool, self.write)
            except Exception:
                log.exception("writing the metrics textfile failed")
            await asyncio.sleep(self.interval_s)

    def write(self) -> None:
        """Written to a temporary file with `textfile_mode` from the start (the metrics name
        tenants), then renamed."""
        assert self.textfile is not None
        data = generate_latest(_WithoutProcess(self.registry))
        temporary = self.textfile.with_name(f".{self.textfile.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self.textfile_mode)
        try:
            os.fchmod(fd, self.textfile_mode)  # what the umask took away, or an older file's mode
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temporary, self.textfile)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


class _WithoutProcess:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if not family.name.startswith("process_"):
                yield family
