"""Both clients behind one blocking face, so one test body checks that they agree."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from prefixd.client import AsyncClient, Client
from tests.waiting import DEADLINE_S
from tests.waiting import settle as settle  # noqa: PLC0414


class AsyncOnThread:
    """An AsyncClient on an event loop of its own thread; every call blocks for its result."""

    def __init__(self, socket_path: Any, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client: AsyncClient = self.run(AsyncClient.connect(socket_path, **options))

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(DEADLINE_S)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            async def invoke() -> Any:
                result = attribute(*args, **kwargs)
                if asyncio.iscoroutine(result):
                    result = await result
                if isinstance(result, asyncio.Future):  # store_from: resolve it here
                    stored = await result
                    done: Future[Any] = Future()
                    done.set_result(stored)
                    return done
                return result

            return self.run(invoke())

        return call

    def close(self) -> None:
        try:
            self.run(self.client.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(DEADLINE_S)
            self.loop.close()


def open_client(kind: str, socket_path: Any, **options: Any) -> Any:
    if kind == "blocking":
        return Client(socket_path, **options)
    return AsyncOnThread(socket_path, **options)


KINDS = ("blocking", "async")


def opener(kind: str) -> Callable[..., Iterator[Any]]:
    @contextlib.contextmanager
    def open_(socket_path: Any, **options: Any) -> Iterator[Any]:
        client = open_client(kind, socket_path, **options)
        try:
            yield client
        finally:
            client.close()

    return open_
