"""The `# SGLang HiCache` block of docs/sglang.md, as far as it runs here: SGLang's engine needs CUDA
kernels and does not start on this machine, so the command line goes through what launch_server
does with it before the engine: SGLang's own argument parser (`prepare_server_args`), its parse of
the extra config (`parse_storage_backend_extra_config`), and the storage attach (the factory's
`create_backend("dynamic", ...)`, tests/integrations/sglang/harness.py), against a daemon of the
test's. Only the socket is changed; `MODEL`, `rev=0123abc` and `sha256:...` stay as written."""

from __future__ import annotations

import re
import shlex

from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.server_args import prepare_server_args

from prefixd.client import Client
from prefixd.integrations.sglang.backend import PrefixdHiCache

from ...daemon.conftest import Daemon
from ...readme import NODE_SOCKET, readme_block
from .harness import PAGE, Controller, fill, host_pool

LAUNCH = ["python", "-m", "sglang.launch_server"]


def test_the_launch_server_command_attaches_prefixd_as_sglang_would(daemon: Daemon) -> None:
    block = readme_block("# SGLang HiCache", "sh", page="docs/sglang.md")
    argv = shlex.split(re.sub(r"\\\n", " ", block))  # the words the shell passes
    assert argv[: len(LAUNCH)] == LAUNCH
    server_args = prepare_server_args(argv[len(LAUNCH) :])
    assert server_args.enable_hierarchical_cache
    assert server_args.hicache_storage_backend == "dynamic"
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(
        server_args.hicache_storage_backend_extra_config
    )
    assert extra["socket"] == NODE_SOCKET
    extra["socket"] = str(daemon.socket)

    controller = Controller(host_pool("layer_first"), extra, model=server_args.model_path)
    assert isinstance(controller.backend, PrefixdHiCache)
    slots = controller.pool.alloc(2 * PAGE)
    fill(controller.pool, slots, seed=1)
    tokens = list(range(2 * PAGE))
    assert controller.backup(tokens, slots) == 2 * PAGE  # stored in the daemon
    assert controller.hit(tokens) == 2 * PAGE
    controller.close()
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert client.stats()["metrics"]["tenants"]["acme"]["stored_blocks"] == 2
