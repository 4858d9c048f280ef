"""prefixd behind LMCache: an L2 adapter of LMCache's node server (multiprocess mode).

Tested against lmcache 0.5.6 (`pip install 'prefixd[lmcache]'` pins it). Load it with

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "prefixd.integrations.lmcache", "class_name": "PrefixdL2Adapter",
        "adapter_params": {"socket": "/run/prefixd/prefixd.sock", "weights": "sha256:..."}}'

(`adapter_params`: identity.py). `PrefixdL2Adapter` (adapter.py) imports LMCache, so it is
imported only when the plugin loader asks for it: the rest works without LMCache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixd.integrations.lmcache.identity import Settings, key_of, split_key

if TYPE_CHECKING:
    from prefixd.integrations.lmcache.adapter import PrefixdL2Adapter

MODULE_PATH = "prefixd.integrations.lmcache"
CLASS_NAME = "PrefixdL2Adapter"


def l2_adapter_config(socket: str, **params: Any) -> dict[str, Any]:
    """The `--l2-adapter` JSON object (as a dict) that loads the adapter with `params`."""
    Settings.from_params({"socket": socket, **params})  # refused here, not in the server
    return {
        "type": "plugin",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "adapter_params": {"socket": str(socket), **params},
    }


def __getattr__(name: str) -> Any:
    """`PrefixdL2Adapter` on first use: LMCache's plugin loader reads it with getattr."""
    if name == CLASS_NAME:
        from prefixd.integrations.lmcache.adapter import PrefixdL2Adapter

        return PrefixdL2Adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CLASS_NAME",
    "MODULE_PATH",
    "PrefixdL2Adapter",
    "key_of",
    "l2_adapter_config",
    "split_key",
]
