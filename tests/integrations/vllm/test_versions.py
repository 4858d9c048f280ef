"""Which vLLM offloading code the tier's and the spec's tests meet: the installed release's, or a
newer one's (PREFIXD_VLLM_OFFLOAD_FROM, .ci/vllm-offload), so a run against 0.33 or 0.34 can
never pass on 0.32's code by mistake."""

from __future__ import annotations

from pathlib import Path

from vllm.v1.kv_offload import base

from .conftest import OFFLOADED
from .direct import resolve_device_pointers


def test_the_offloading_code_is_the_release_named() -> None:
    code = Path(base.__file__).resolve()
    if OFFLOADED:
        assert code.is_relative_to(Path(OFFLOADED).resolve())
    else:
        assert "site-packages" in code.parts


def test_the_worker_gets_what_that_releases_connector_hands_it() -> None:
    """0.34 on: device pointers (compat.blocks_of reads them); before: a GPULoadStoreSpec."""
    pointers = (Path(base.__file__).parent / "pointer_utils.py").exists()
    assert (resolve_device_pointers is not None) == pointers
