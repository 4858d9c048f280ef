"""A multimodal model through the daemon: its blocks are named by the images their placeholders
stand for, so the same token ids with another image never restore the first image's state."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from prefixd.client import Client
from prefixd.errors import IdentityError, TokenError

from ..integrations import multimodal
from .conftest import Daemon
from .test_hybrid_models import restored_in_a_fresh_process


def test_a_multimodal_prompt_restores_exactly_and_only_with_its_image(daemon: Daemon) -> None:
    with Client(daemon.socket, region_bytes=16 << 20) as client:
        assert multimodal.store(client, "cat") == multimodal.PREFIX // multimodal.BLOCK
    daemon.restart()
    results = restored_in_a_fresh_process("tests.integrations.multimodal", daemon, key="image")
    cat, dog = results["cat"], results["dog"]
    assert cat["reusable_tokens"] == multimodal.PREFIX and cat["diff"] <= multimodal.TOL
    # the same token ids with another image: the hit ends at the image's first block
    assert dog["reusable_tokens"] == multimodal.IMAGE_AT and dog["diff"] <= multimodal.TOL


def test_the_daemon_refuses_a_multimodal_identity_whose_blocks_ignore_the_images(
    daemon: Daemon,
) -> None:
    config, _ = multimodal.build()
    blind = replace(multimodal.identity(config), request_content=False)
    tokens = multimodal.inputs("cat")["input_ids"][0].numpy()
    with Client(daemon.socket) as client:
        with pytest.raises(IdentityError, match="request_content"):
            client.lookup_state(blind, [tokens])
        with pytest.raises(TokenError, match="not by token ids alone"):
            client.lookup_state(multimodal.identity(config), [tokens])
