"""Joint prefixes of hybrid identities: where every state group is complete at once.

A paged group's page hangs on its last block (whose hash covers every token the page holds: on its
first, prompts that part after it would share one page), a checkpoint on the block ending at its
boundary. A boundary is reusable when the chain is stored up to it, every paged group covers it
and every stored checkpoint group has a checkpoint there; the answer is the largest. A put is
checked here before any transaction, so nothing is written for a refused one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lmdb

from prefixd.errors import CorruptRecordError, IdentityError, OpenTailError, PayloadError
from prefixd.schema.identity import Identity
from prefixd.schema.records import PartRecord, part_key
from prefixd.schema.state import CHECKPOINT, PAGED, StateGroup, StateSpec
from prefixd.store.codec import payload_view
from prefixd.store.results import JointMatch, PartRef
from prefixd.store.tables import Tables, decoded_part, prefixed


def require_hybrid(identity: Identity, plain_method: str) -> StateSpec:
    if identity.state is None:
        raise IdentityError(
            "state", f"is not set: an identity without state groups uses {plain_method}"
        )
    return identity.state


def require_plain(identity: Identity, hybrid_method: str) -> None:
    """The plain calls would report a prefix no state group backs (a partial hit), so they refuse a
    hybrid identity."""
    if identity.state is not None:
        raise IdentityError("state", f"is set: an identity with state groups uses {hybrid_method}")


def anchor(group: StateGroup, block: int) -> int:
    """The block a part of `group` starting at `block` hangs on: a page's last block, a
    checkpoint's own."""
    return block + group.page_blocks - 1 if group.kind == PAGED else block


@dataclass(frozen=True)
class PlannedPart:
    group: int
    block_index: int
    view: memoryview


def joint_match(
    txn: lmdb.Transaction,
    tables: Tables,
    spec: StateSpec,
    identity: Identity,
    hashes: Sequence[bytes],
    damaged: list[bytes],
) -> JointMatch:
    """The joint boundary over the stored chain `hashes`; parts that fail verification go to
    `damaged` (by block) and count as missing. A page the chain ends inside is a longer stored
    prompt's: its first blocks are this chain's (KV is causal), a byte prefix of the page."""
    parts_db = tables.parts
    assert parts_db is not None  # a store whose identities have state has the parts table
    identity_digest, block_tokens = identity.digest, identity.block_tokens
    get = txn.cursor(db=parts_db).get
    found: dict[tuple[int, int], tuple[PartRecord, bytes]] = {}  # with the block it hangs on
    children = txn.cursor(db=tables.children)

    def below(h: bytes, depth: int) -> bytes | None:
        """A stored block `depth` blocks below `h` (first children: any longer prompt will do)."""
        for _ in range(depth):
            if not children.set_key(h):
                return None
            h = bytes(children.value())
        return h

    def part(group: int, block: int) -> PartRecord | None:
        hung = anchor(spec[group], block)
        ours = hung < len(hashes)  # else a longer prompt's page: damage there is its to find
        h = hashes[hung] if ours else below(hashes[-1], hung - len(hashes) + 1)
        raw = None if h is None else get(part_key(h, group))
        if h is None or raw is None:
            return None
        try:
            record = PartRecord.decode(raw)
        except CorruptRecordError:
            record = None
        if record is None or record.group != group or record.block_index != block:
            if ours:
                damaged.append(h)
            return None
        found[group, block] = record, h
        return record

    paged = len(hashes)
    for gi, group in enumerate(spec):
        if group.kind != PAGED:
            continue
        for start in range(0, paged, group.page_blocks):
            if part(gi, start) is None:
                paged = start
                break
    checkpointed = [gi for gi, g in enumerate(spec) if g.kind == CHECKPOINT and g.stored]
    reusable = paged
    while checkpointed and reusable > 0:
        if all(part(gi, reusable - 1) is not None for gi in checkpointed):
            break
        reusable -= 1
    replay = max((g.replay_tokens for g in spec if not g.stored), default=0)
    replay_from = max(0, reusable * block_tokens - replay) // block_tokens * block_tokens
    parts: list[PartRef] = []

    def add(group: StateGroup, gi: int, block: int, first_token: int, tokens: int) -> None:
        record, hung = found[gi, block]
        parts.append(PartRef(group.name, hung, block, record.payload_size, first_token, tokens))

    for gi, group in enumerate(spec):
        if group.kind == PAGED:
            span = group.page_blocks * block_tokens
            for start in range(0, reusable, group.page_blocks):
                add(group, gi, start, start * block_tokens, span)
        elif group.stored and reusable:
            add(group, gi, reusable - 1, reusable * block_tokens, 0)
    return JointMatch(
        identity_digest,
        block_tokens,
        reusable * block_tokens,
        replay_from,
        paged * block_tokens,
        len(hashes) * block_tokens,
        tuple(hashes[:reusable]),
        tuple(parts),
    )


def plan_put(
    spec: StateSpec,
    block_tokens: int,
    first_block: int,
    end_block: int,
    paged: Mapping[str, Sequence[Any]],
    checkpoints: Mapping[str, Mapping[int, Any]],
) -> list[PlannedPart]:
    """The parts a put of blocks [first_block, end_block) stores, checked against the spec:
    OpenTailError for state that is not closed, PayloadError for any other mismatch."""
    groups = {g.name: (gi, g) for gi, g in enumerate(spec)}
    for name in (*paged, *checkpoints):
        if name not in groups:
            raise PayloadError(f"state group {name!r} is not in the identity's state spec")
    planned: list[PlannedPart] = []
    for gi, group in enumerate(spec):
        if group.kind == PAGED:
            planned += _plan_pages(gi, group, first_block, end_block, paged.get(group.name))
        elif group.name in paged:
            raise PayloadError(f"state group {group.name!r} is a checkpoint group, not paged")
        else:
            planned += _plan_checkpoints(
                gi, group, block_tokens, first_block, end_block, checkpoints.get(group.name, {})
            )
    return planned


def _plan_pages(
    gi: int, group: StateGroup, first: int, end: int, pages: Sequence[Any] | None
) -> list[PlannedPart]:
    k = group.page_blocks
    if end > first and end % k:
        open_page = end - end % k
        raise OpenTailError(
            f"state group {group.name!r}: the page of blocks {open_page}..{open_page + k - 1} is "
            f"not closed (the put ends at block {end}); only closed pages are stored"
        )
    # the pages hung on the put's blocks (a page hangs on its last block)
    starts = list(range(first // k * k, end, k)) if end > first else []
    given = list(pages or ())
    if len(given) != len(starts):
        raise PayloadError(
            f"state group {group.name!r}: {len(given)} page payload(s) for {len(starts)} page(s) "
            f"ending in blocks {first}..{end - 1}"
        )
    return [
        PlannedPart(gi, s, payload_view(p, f"state group {group.name!r}: page at block {s}"))
        for s, p in zip(starts, given)
    ]


def _plan_checkpoints(
    gi: int, group: StateGroup, block_tokens: int, first: int, end: int, given: Mapping[int, Any]
) -> list[PlannedPart]:
    if not isinstance(given, Mapping):
        raise PayloadError(f"state group {group.name!r}: checkpoints must map boundary -> payload")
    if given and not group.stored:
        raise PayloadError(f"state group {group.name!r} has policy 'none': nothing of it is stored")
    planned = []
    for boundary, payload in sorted(given.items(), key=lambda item: _boundary_sort(item[0])):
        if isinstance(boundary, bool) or not isinstance(boundary, int):
            raise PayloadError(f"state group {group.name!r}: boundary {boundary!r} is not an int")
        if boundary % block_tokens:
            raise OpenTailError(
                f"state group {group.name!r}: a checkpoint at token {boundary} is past the last "
                f"closed block boundary; only state at a multiple of {block_tokens} is stored"
            )
        if not 0 < boundary <= (last := end * block_tokens):
            raise PayloadError(
                f"state group {group.name!r}: boundary {boundary} is outside 1..{last}"
            )
        if group.policy == "periodic" and boundary % group.period_tokens:
            raise PayloadError(
                f"state group {group.name!r}: policy 'periodic' stores only multiples of "
                f"{group.period_tokens} tokens, not {boundary}"
            )
        what = f"state group {group.name!r}: checkpoint at {boundary}"
        planned.append(PlannedPart(gi, boundary // block_tokens - 1, payload_view(payload, what)))
    required = _required_boundaries(group, block_tokens, first, end)
    missing = sorted(required - set(given))
    if missing:
        raise PayloadError(
            f"state group {group.name!r} has policy {group.policy!r}: the put needs a checkpoint "
            f"at token {missing[0]}"
        )
    return planned


def _required_boundaries(group: StateGroup, block_tokens: int, first: int, end: int) -> set[int]:
    new = range((first + 1) * block_tokens, end * block_tokens + 1, block_tokens)
    if group.policy == "full":
        return set(new)
    if group.policy == "periodic":
        return {b for b in new if b % group.period_tokens == 0}
    return set()


def _boundary_sort(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def part_bytes(txn: lmdb.Transaction, parts_db: lmdb._Database | None, block: bytes) -> int:
    if parts_db is None:
        return 0
    parts = (decoded_part(raw) for _, raw in prefixed(txn.cursor(db=parts_db), block))
    return sum(part.stored_size for part in parts if part is not None)
