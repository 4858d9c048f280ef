"""Retiring a model's old entries when its weights change on disk: each served model is
fingerprinted from its manifest files (on a thread), the fingerprint is the identity's `weights`,
and after a manifest changes (and settles) every entry of the model with other weights is purged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from prefixd.schema.fingerprint import fingerprint_files

log = logging.getLogger(__name__)

SETTLE_S = 0.5  # a copy of new weights writes several files: wait for quiet before fingerprinting
Retire = Callable[[str, str], Awaitable[int]]  # (model, fingerprint to keep) -> blocks removed


async def fingerprint(paths: tuple[Path, ...]) -> str:
    return await asyncio.to_thread(fingerprint_files, paths)


class ManifestWatcher:
    """Keeps `fingerprints` current and calls `retire` when a model's fingerprint changes."""

    def __init__(self, models: Mapping[str, tuple[Path, ...]], retire: Retire) -> None:
        self.models = dict(models)
        self.fingerprints: dict[str, str] = {}
        self._retire = retire
        self._observer = Observer()
        self._pending: dict[str, asyncio.TimerHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # one refresh of a model at a time, and only its latest applies: an older one finishing
        # last would name (and retire in favour of) weights no longer on disk
        self._refreshing: dict[str, asyncio.Lock] = {}
        self._changes: dict[str, int] = {}  # changes seen per model: which refresh is the latest
        self.checks = 0  # fingerprints recomputed after a change was seen (changed or not)

    async def start(self) -> None:
        """Fingerprint every model, retire other versions already stored, watch."""
        self._loop = asyncio.get_running_loop()
        for model, paths in self.models.items():
            self.fingerprints[model] = await fingerprint(paths)
            await self._retire(model, self.fingerprints[model])
        by_directory: dict[Path, dict[str, str]] = {}
        for model, paths in self.models.items():
            for path in paths:
                by_directory.setdefault(path.parent, {})[path.name] = model
        for directory, names in by_directory.items():
            directory.mkdir(parents=True, exist_ok=True)
            self._observer.schedule(_Handler(names, self._changed), str(directory))
        self._observer.start()

    async def watch(self, models: Mapping[str, tuple[Path, ...]]) -> None:
        """Watch `models` instead (a reload), as a start does."""
        await self.stop()
        self._observer = Observer()
        self._pending.clear()
        self.models = dict(models)
        for model in set(self.fingerprints) - set(self.models):
            del self.fingerprints[model]  # in place: the operations read this very dict
        await self.start()

    async def stop(self) -> None:
        for handle in self._pending.values():
            handle.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._observer.stop()
        if self._observer.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._observer.join)

    def _changed(self, model: str) -> None:
        """On the observer's thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._debounce, model)

    def _debounce(self, model: str) -> None:
        assert self._loop is not None
        previous = self._pending.pop(model, None)
        if previous is not None:
            previous.cancel()
        self._pending[model] = self._loop.call_later(SETTLE_S, self._spawn, model)

    def _spawn(self, model: str) -> None:
        self._pending.pop(model, None)
        change = self._changes[model] = self._changes.get(model, 0) + 1
        task = asyncio.ensure_future(self._refresh(model, change))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh(self, model: str, change: int) -> None:
        try:
            async with self._refreshing.setdefault(model, asyncio.Lock()):
                new = await fingerprint(self.models[model])
                if change != self._changes[model] or new == self.fingerprints.get(model):
                    return  # the files changed again meanwhile: the later refresh decides
                self.fingerprints[model] = new
                try:
                    removed = await self._retire(model, new)
                except Exception:
                    log.exception("retiring old versions of a model failed")
                    return
            log.info(
                "model %s changed weights; retired %d block(s) of other versions", model, removed
            )
        finally:
            self.checks += 1


class _Handler(FileSystemEventHandler):
    def __init__(self, names: Mapping[str, str], changed: Callable[[str], None]) -> None:
        self._names = dict(names)
        self._changed = changed

    def on_any_event(self, event: FileSystemEvent) -> None:
        for raw in (event.src_path, getattr(event, "dest_path", "")):
            name = Path(raw if isinstance(raw, str) else raw.decode()).name if raw else ""
            model = self._names.get(name)
            if model is not None:
                self._changed(model)
