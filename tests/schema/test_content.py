"""Per-request content in the chain: a block's name covers the media items its placeholder tokens
stand for (with their offsets), the request's adapter and its cache salt, the way vLLM's
`extra_keys` do; and an identity that needs it refuses prompts without it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixd import Identity, MediaItem, Prompt, chain_hashes
from prefixd.errors import IdentityError, TokenError
from prefixd.schema.content import NO_CONTENT, block_contents, chain_words, token_part
from prefixd.schema.identity import CONTENT_WORDS

TEXT = Identity(
    model="tiny-vlm",
    weights="seed-0",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="f32",
    block_tokens=4,
    tenant="a",
)
MM = replace(TEXT, mm="clip-224@1", request_content=True)
TOKENS = list(range(100, 124))  # 6 blocks
IMAGE_AT = 9  # placeholders [9, 15): blocks 2 and 3


def image(name: str = "cat", at: int = IMAGE_AT, length: int = 6) -> MediaItem:
    return MediaItem(name, at, length)


def common_blocks(a: Prompt, b: Prompt, identity: Identity = MM) -> int:
    ha, hb = chain_hashes(identity, a), chain_hashes(identity, b)
    return next((i for i, (x, y) in enumerate(zip(ha, hb)) if x != y), min(len(ha), len(hb)))


def test_another_image_misses_from_the_first_block_it_touches() -> None:
    cat, dog = Prompt(TOKENS, (image("cat"),)), Prompt(TOKENS, (image("dog"),))
    assert common_blocks(cat, dog) == IMAGE_AT // 4
    assert chain_hashes(MM, cat) == chain_hashes(MM, Prompt(TOKENS, (image("cat"),)))


def test_the_same_image_at_another_offset_misses_from_there() -> None:
    here, later = Prompt(TOKENS, (image(at=9),)), Prompt(TOKENS, (image(at=13),))
    assert common_blocks(here, later) == 2
    # in the same block at another offset is other content too
    assert common_blocks(Prompt(TOKENS, (image(at=8),)), here) == 2


def test_adapter_and_salt_change_every_block() -> None:
    plain = Prompt(TOKENS)
    for other in (Prompt(TOKENS, adapter="sql-lora"), Prompt(TOKENS, salt="user-7")):
        assert common_blocks(plain, other) == 0
    assert common_blocks(Prompt(TOKENS, salt="a"), Prompt(TOKENS, salt="b")) == 0


def test_text_only_blocks_carry_no_content() -> None:
    digests = block_contents(Prompt(TOKENS, (image(),)), 6, 4)
    assert digests[:2] == [NO_CONTENT] * 2 and digests[4:] == [NO_CONTENT] * 2
    assert NO_CONTENT not in digests[2:4]
    words = chain_words(MM, Prompt(TOKENS))
    assert len(words) == 6 * (4 + CONTENT_WORDS)
    assert token_part(MM, words.tobytes()) == chain_words(TEXT, TOKENS).tobytes()


def test_an_open_tail_follows_as_token_ids() -> None:
    words = chain_words(MM, Prompt(TOKENS[:10]))
    assert words.tolist()[-2:] == TOKENS[8:10] and len(words) == 2 * 8 + 2
    assert len(chain_hashes(MM, Prompt(TOKENS[:10]))) == 2


def test_the_order_items_are_given_in_is_not_content() -> None:
    a, b = MediaItem("a", 1, 2), MediaItem("b", 2, 5)
    assert chain_hashes(MM, Prompt(TOKENS, (a, b))) == chain_hashes(MM, Prompt(TOKENS, (b, a)))


def test_a_prompt_needs_an_identity_with_request_content_and_back() -> None:
    with pytest.raises(TokenError, match="no request_content"):
        chain_hashes(TEXT, Prompt(TOKENS))
    with pytest.raises(TokenError, match="not by token ids alone"):
        chain_hashes(MM, TOKENS)
    # packed words are the wire form: taken as they are
    assert chain_hashes(MM, chain_words(MM, Prompt(TOKENS)).tobytes()) == chain_hashes(
        MM, Prompt(TOKENS)
    )


def test_a_multimodal_identity_without_request_content_is_not_servable() -> None:
    with pytest.raises(IdentityError, match="request_content"):
        replace(MM, request_content=False).servable()
    assert MM.servable() is MM and TEXT.servable() is TEXT
    engine_keyed = replace(TEXT, mm="clip", key_bytes=36)  # its keys cover the content
    assert engine_keyed.servable() is engine_keyed
    with pytest.raises(IdentityError, match="engine-keyed"):
        replace(engine_keyed, request_content=True)


def test_request_content_is_part_of_the_identity() -> None:
    assert MM.digest != replace(MM, request_content=False).digest
    assert Identity.decode(MM.encode()) == MM
    assert Identity.from_dict(MM.to_dict()) == MM
    assert "request_content" not in TEXT.to_dict()
    assert MM.block_words == 4 + CONTENT_WORDS and TEXT.block_words == 4


@pytest.mark.parametrize(
    "bad",
    [
        lambda: MediaItem("", 0, 1),
        lambda: MediaItem("x", -1, 1),
        lambda: MediaItem("x", 0, 0),
        lambda: MediaItem("x", True, 1),
        lambda: MediaItem(b"x" * 257, 0, 1),
        lambda: Prompt(TOKENS, ("not an item",)),  # type: ignore[arg-type]
        lambda: Prompt(TOKENS, salt=""),
        lambda: Prompt(TOKENS, adapter="\ud800"),
    ],
)
def test_malformed_content_is_refused(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TokenError):
        bad()


items = st.lists(
    st.builds(MediaItem, st.sampled_from(["a", "b"]), st.integers(0, 30), st.integers(1, 12)),
    max_size=4,
)


@given(items, items)
def test_blocks_agree_exactly_up_to_the_first_block_whose_content_differs(x, y) -> None:  # type: ignore[no-untyped-def]
    a, b = Prompt(TOKENS, tuple(x)), Prompt(TOKENS, tuple(y))
    da, db = block_contents(a, 6, 4), block_contents(b, 6, 4)
    first = next((i for i in range(6) if da[i] != db[i]), 6)
    assert common_blocks(a, b) == first
    # a block's content is exactly the items that overlap it, with their offsets
    for i in range(6):
        assert (da[i] == db[i]) == (touching(a, i) == touching(b, i))


def touching(prompt: Prompt, block: int) -> list[tuple[bytes, int, int]]:
    start, end = 4 * block, 4 * block + 4
    return sorted(
        (m.hash_bytes, m.offset, m.length)
        for m in prompt.items
        if m.offset < end and m.offset + m.length > start
    )
