"""The shared tier's client in a process of its own: `python -m prefixd.cluster.tier_child FD`, run
by prefixd.cluster.child.ChildTier on its end of a SOCK_SEQPACKET pair. The first message names the
function that opens the tier; every other is a call, answered from a thread of its own (calls
overlap). Buffers are memfds both processes map (`map`). A stall here (Mooncake holding the GIL)
stalls only this process, which ends with its parent (PR_SET_PDEATHSIG, end of file).
"""

from __future__ import annotations

import ctypes
import importlib
import mmap
import os
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np

from prefixd.cluster.wire_tier import MAX_MESSAGE, TierCall, TierReply, TierStart, error_reply

_PR_SET_PDEATHSIG = 1


class _Child:
    def __init__(self, sock: socket.socket, tier: Any) -> None:
        self.sock = sock
        self.tier = tier
        self.buffers: dict[int, np.ndarray] = {}  # buffer id -> its mapping, as bytes
        self.send_lock = threading.Lock()
        self.encoder = msgspec.msgpack.Encoder()

    def serve(self, workers: int) -> None:
        decoder = msgspec.msgpack.Decoder(TierCall)
        with ThreadPoolExecutor(workers, thread_name_prefix="tier") as pool:
            while True:
                message, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
                if not message:
                    break  # the parent is gone, or closed its end
                call = decoder.decode(message)
                if call.op == "map":  # in order, before any call that names the buffer
                    self._map(call, fds)
                    continue
                if call.op == "unmap":  # after the last call that named it
                    self.buffers.pop(call.buffer, None)
                    continue
                pool.submit(self._answer, call)
        self.tier.close()

    def _map(self, call: TierCall, fds: list[int]) -> None:
        [fd] = fds
        mapped = mmap.mmap(fd, call.length)
        os.close(fd)
        self.buffers[call.buffer] = np.frombuffer(mapped, dtype=np.uint8)

    def _answer(self, call: TierCall) -> None:
        try:
            result = self._run(call)
        except Exception as exc:  # noqa: BLE001 - every failure goes back as a reply
            reply = error_reply(call.id, exc, self.tier.in_flight)
        else:
            reply = TierReply(id=call.id, result=result, in_flight=self.tier.in_flight)
        data = self.encoder.encode(reply)
        with self.send_lock:
            self.sock.sendall(data)

    def _view(self, call: TierCall) -> np.ndarray:
        array = self.buffers[call.buffer]
        return array[call.offset : call.offset + call.length]

    def _run(self, call: TierCall) -> Any:
        tier, view = self.tier, self._view
        key = call.keys[0] if call.keys else ""
        run = {
            "put": lambda: tier.put(key, view(call), overwrite=call.flag),
            "get_into": lambda: tier.get_into(key, view(call)),
            "get_many_into": lambda: tier.get_many_into(call.keys, view(call), call.capacity),
            "size": lambda: tier.size(key),
            "exists_many": lambda: tier.exists_many(call.keys),
            "remove": lambda: tier.remove(key, force=call.flag),
            "remove_prefix": lambda: tier.remove_prefix(key, force=call.flag),
            "connect": tier.connect,
            "close": tier.close,
        }.get(call.op)
        if run is None:
            raise ValueError(f"unknown tier call {call.op!r}")
        return run()


def main(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    if os.getppid() == 1:
        return  # the parent died before the death signal was armed
    start = msgspec.msgpack.decode(sock.recv(MAX_MESSAGE), type=TierStart)
    module, _, name = start.factory.partition(":")
    tier = getattr(importlib.import_module(module), name)(**start.settings)
    child = _Child(sock, tier)
    sock.sendall(child.encoder.encode(TierReply(id=0, result=os.getpid())))
    child.serve(start.workers)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the tier is closed; Mooncake's exit handlers and threads have nothing to add


if __name__ == "__main__":
    main(int(sys.argv[1]))
