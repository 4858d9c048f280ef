"""A request's own content in the chain: for an identity with `request_content`, each closed
block's words are its token ids and then the digest of the content they stand for, so a block's
hash covers that content and the store compares it on every hit, like the token ids.

A block's content is the media items whose placeholder tokens overlap it (each with its offset and
length: the same image elsewhere is other content), the request's adapter and its cache salt. A
block that has none of them gets zero words, so text-only prompts share their blocks as ever; the
blocks after an image differ anyway, through their parents. This is what vLLM's `extra_keys` do.
"""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np

from prefixd.errors import TokenError
from prefixd.schema.identity import CONTENT_WORDS, Identity
from prefixd.schema.tokens import TOKEN_BYTES, TOKEN_DTYPE, Prompt, PromptIds, as_token_array

CONTENT_BYTES = CONTENT_WORDS * TOKEN_BYTES
NO_CONTENT = bytes(CONTENT_BYTES)
_CONTENT_FORMAT = "prefixd.content.v1"


def block_contents(prompt: Prompt, n_blocks: int, block_tokens: int) -> list[bytes]:
    """The content digest of each of the first `n_blocks` blocks of `prompt`."""
    touching: list[list[list[object]]] = [[] for _ in range(n_blocks)]
    for item in prompt.items:
        first = item.offset // block_tokens
        last = min(n_blocks, -(-(item.offset + item.length) // block_tokens))
        for index in range(first, last):
            touching[index].append([item.hash_bytes, item.offset, item.length])
    common = prompt.adapter is not None or prompt.salt is not None
    digests = []
    for items in touching:
        if not items and not common:
            digests.append(NO_CONTENT)
            continue
        items.sort(key=lambda i: (i[1], i[2], i[0]))  # canonical: the order given is no content
        encoded = msgpack.packb(
            [_CONTENT_FORMAT, prompt.adapter, prompt.salt, items], use_bin_type=True
        )
        digests.append(hashlib.blake2b(encoded, digest_size=CONTENT_BYTES).digest())
    return digests


def chain_words(identity: Identity, ids: PromptIds) -> np.ndarray:
    """The '<u4' words the chain of `identity` names `ids` by: the token ids themselves, or for an
    identity with request_content, each closed block's token ids then its content digest (an
    open tail's token ids follow as they are). Packed bytes are taken as words already (the wire
    form); a request-content identity takes nothing else but a Prompt, so a prompt whose content
    was left out fails here instead of missing (or hitting text-only state) without a word."""
    if isinstance(ids, Prompt):
        if not identity.request_content:
            raise TokenError(
                "this identity has no request_content: its blocks cannot cover a prompt's "
                "media items, adapter or salt (pass the token ids alone, or use an identity "
                "with request_content=True)"
            )
        return _with_content(identity, ids)
    if identity.request_content and not isinstance(ids, bytes | bytearray | memoryview):
        raise TokenError(
            "an identity with request_content names a prompt by a prefixd.Prompt (its token ids "
            "and their media items, adapter and salt), not by token ids alone"
        )
    return as_token_array(ids)


def _with_content(identity: Identity, prompt: Prompt) -> np.ndarray:
    tokens = as_token_array(prompt.token_ids)
    bt = identity.block_tokens
    n_blocks = len(tokens) // bt
    digests = np.frombuffer(b"".join(block_contents(prompt, n_blocks, bt)), dtype=TOKEN_DTYPE)
    closed = tokens[: n_blocks * bt].reshape(n_blocks, bt)
    words = np.concatenate((closed, digests.reshape(n_blocks, CONTENT_WORDS)), axis=1)
    return np.concatenate((words.ravel(), tokens[n_blocks * bt :]))


def token_part(identity: Identity, words: bytes | memoryview) -> bytes:
    """The token ids of closed blocks' words (what a router or a warm-up reads): the words
    themselves, less each block's content digest for an identity with request_content."""
    if not identity.request_content:
        return bytes(words)
    array = np.frombuffer(words, dtype=TOKEN_DTYPE)
    width = identity.block_words
    n_blocks = len(array) // width
    return array[: n_blocks * width].reshape(n_blocks, width)[:, : identity.block_tokens].tobytes()


__all__ = ["CONTENT_BYTES", "NO_CONTENT", "block_contents", "chain_words", "token_part"]
