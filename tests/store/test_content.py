"""The store serves a request-content identity's blocks only to a prompt with the same content:
the content digest stands in each record beside the token ids and is compared on every hit."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prefixd import Prompt, Store
from prefixd.schema.chain import packed_hashes

from ..schema.test_content import MM, TOKENS, image
from .test_faults import open_store, random_payloads

N_BLOCKS = len(TOKENS) // MM.block_tokens
SIZE = 4096


def load(store: Store, prompt: Prompt, hashes: bytes | None = None) -> list[bytes]:
    out = bytearray(2 * SIZE * N_BLOCKS)
    loaded = store.load(MM, prompt, out, hashes=hashes)
    return [bytes(out[o : o + s]) for o, s in zip(loaded.offsets, loaded.sizes)]


def test_the_same_tokens_with_another_image_hit_only_before_it(tmp_path: Path) -> None:
    cat, dog = Prompt(TOKENS, (image("cat"),)), Prompt(TOKENS, (image("dog"),))
    payloads = random_payloads(N_BLOCKS, SIZE)
    with open_store(tmp_path / "s") as store:
        assert store.put(MM, cat, payloads).stored == N_BLOCKS
        assert load(store, cat) == payloads
        assert store.longest_prefix(MM, dog).n_blocks == 2  # the image starts in block 2
        assert load(store, dog) == payloads[:2]
        # the same image later: its blocks 2 and 3 are text here, the stored ones held the image
        elsewhere = Prompt(TOKENS, (image("cat", at=17),))
        assert store.longest_prefix(MM, elsewhere).n_blocks == 2
        assert store.longest_prefix(MM, Prompt(TOKENS, salt="other-user")).n_blocks == 0
        assert store.check() == []


def test_content_is_compared_on_every_hit_not_only_hashed(tmp_path: Path) -> None:
    """A client that names the blocks by another prompt's hashes (as a collision would) still
    gets only what its own words match."""
    cat, dog = Prompt(TOKENS, (image("cat"),)), Prompt(TOKENS, (image("dog"),))
    payloads = random_payloads(N_BLOCKS, SIZE)
    with open_store(tmp_path / "s") as store:
        store.put(MM, cat, payloads)
        cat_hashes = packed_hashes(MM, cat)
        assert store.longest_prefix(MM, dog, hashes=cat_hashes).n_blocks == 2
        assert load(store, dog, cat_hashes) == payloads[:2]
        assert store.longest_prefix(MM, cat, hashes=cat_hashes).n_blocks == N_BLOCKS


def test_text_only_prompts_share_blocks_under_a_request_content_identity(tmp_path: Path) -> None:
    payloads = random_payloads(N_BLOCKS, SIZE)
    with open_store(tmp_path / "s") as store:
        store.put(MM, Prompt(np.array(TOKENS)), payloads)
        assert load(store, Prompt(TOKENS)) == payloads
        # an image late in the prompt reuses the text before it
        assert store.longest_prefix(MM, Prompt(TOKENS, (image(at=20, length=2),))).n_blocks == 5
