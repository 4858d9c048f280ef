"""prefixd behind SGLang: an L3 storage backend of SGLang's HiCache (`HiCacheStorage`).

Tested against sglang 0.5.23 (`pip install 'prefixd[sglang]'` pins it). SGLang loads it as a
dynamic backend:

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
          "backend_name": "prefixd", "module_path": "prefixd.integrations.sglang",
          "class_name": "PrefixdHiCache", "socket": "/run/prefixd/prefixd.sock",
          "weights": "rev=0123abc", "interface_v1": 1}'

`extra_config(socket=..., weights=...)` builds that JSON's dict. `PrefixdHiCache` (backend.py)
imports sglang, so it is imported only when loaded: `extra_config` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixd.integrations.sglang.backend import PrefixdHiCache

MODULE_PATH = "prefixd.integrations.sglang"
CLASS_NAME = "PrefixdHiCache"


def extra_config(
    *,
    socket: str,
    weights: str,
    tokenizer: str | None = None,
    template: str | None = None,
    tenant: str = "default",
    interface_v1: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """SGLang's `--hicache-storage-backend-extra-config` for prefixd. `options`: "model", "rope",
    "adapter", "region_bytes", "timeout_s", "daemon_uid", "pools" ({pool name: hit policy})."""
    config: dict[str, Any] = {
        "backend_name": "prefixd",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "socket": str(socket),
        "weights": weights,
        "tenant": tenant,
        "interface_v1": 1 if interface_v1 else 0,
        **options,
    }
    if tokenizer is not None:
        config["tokenizer"] = tokenizer
    if template is not None:
        config["template"] = template
    return config


def __getattr__(name: str) -> Any:
    """`PrefixdHiCache` on first use: SGLang's factory loads it as `module_path` + `class_name`."""
    if name == CLASS_NAME:
        from prefixd.integrations.sglang.backend import PrefixdHiCache

        return PrefixdHiCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CLASS_NAME", "MODULE_PATH", "PrefixdHiCache", "extra_config"]
