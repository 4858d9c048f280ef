"""The state spec of a hybrid model: which kinds of prefix state it keeps, and where.

A model may keep several kinds of prefix state (full KV, MLA latents, compressed entries, indexer
keys, sliding windows, recurrent states). Each is a named group of one kind:

  paged       one stored value per page of `page_blocks` hash blocks, needed for every block of a
              hit (full KV, MLA latents, DeepSeek-V4 compressed entries and indexer keys);
  checkpoint  values only at chosen block boundaries (a sliding window, a recurrent state, a
              compressor's open buffer), under a policy:
                chosen    wherever the engine chooses to store one (sparse snapshots);
                full      at every boundary: a put of new blocks must carry one for each;
                periodic  exactly at the multiples of `period_tokens` (a multiple of the block);
                none      never stored: restoring at a boundary needs a replay of at most
                          `replay_tokens` tokens before it (n_win x the sliding layers).

The lookup granularity is the identity's `block_tokens`; `page_blocks` is the physical granularity
and the checkpoint policy the snapshot granularity, so the three are set independently. The spec is
part of the identity's digest: two engines that keep their state differently never share entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixd.errors import IdentityError

PAGED = "paged"
CHECKPOINT = "checkpoint"
KINDS = (PAGED, CHECKPOINT)
POLICIES = ("chosen", "full", "periodic", "none")
MAX_GROUPS = 32
MAX_GROUP_NAME_BYTES = 64
MAX_PAGE_BLOCKS = 1 << 16
_FIELDS = ("name", "kind", "page_blocks", "policy", "period_tokens", "replay_tokens")


@dataclass(frozen=True)
class StateGroup:
    """One named kind of prefix state; build with `StateGroup.paged` or `StateGroup.checkpoint`."""

    name: str
    kind: str
    page_blocks: int = 1
    policy: str = "chosen"
    period_tokens: int = 0
    replay_tokens: int = 0

    @classmethod
    def paged(cls, name: str, *, page_blocks: int = 1) -> StateGroup:
        return cls(name, PAGED, page_blocks=page_blocks, policy="full")

    @classmethod
    def checkpoint(
        cls,
        name: str,
        *,
        policy: str = "chosen",
        period_tokens: int = 0,
        replay_tokens: int = 0,
    ) -> StateGroup:
        return cls(
            name,
            CHECKPOINT,
            policy=policy,
            period_tokens=period_tokens,
            replay_tokens=replay_tokens,
        )

    @property
    def stored(self) -> bool:
        """Whether any payload of this group is ever stored."""
        return self.kind == PAGED or self.policy != "none"

    def check(self, block_tokens: int) -> None:
        """Raise IdentityError unless the group is consistent with itself and the block size."""
        where = f"state group {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise IdentityError("state", "a group name must be a non-empty str")
        if len(self.name.encode("utf-8", "replace")) > MAX_GROUP_NAME_BYTES:
            raise IdentityError("state", f"{where}: name longer than {MAX_GROUP_NAME_BYTES} bytes")
        for number in ("page_blocks", "period_tokens", "replay_tokens"):
            value = getattr(self, number)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise IdentityError("state", f"{where}: {number} must be a non-negative int")
        if self.kind not in KINDS:
            raise IdentityError("state", f"{where}: kind must be one of {KINDS}")
        if self.kind == PAGED:
            if not 1 <= self.page_blocks <= MAX_PAGE_BLOCKS:
                raise IdentityError(
                    "state", f"{where}: page_blocks must be in 1..{MAX_PAGE_BLOCKS}"
                )
            if self.policy != "full" or self.period_tokens or self.replay_tokens:
                raise IdentityError("state", f"{where}: a paged group takes only page_blocks")
            return
        if self.page_blocks != 1:
            raise IdentityError("state", f"{where}: page_blocks applies to paged groups only")
        if self.policy not in POLICIES:
            raise IdentityError("state", f"{where}: policy must be one of {POLICIES}")
        if self.policy == "periodic":
            if not self.period_tokens or self.period_tokens % block_tokens:
                raise IdentityError(
                    "state",
                    f"{where}: period_tokens must be a positive multiple of {block_tokens}",
                )
        elif self.period_tokens:
            raise IdentityError("state", f"{where}: period_tokens needs policy 'periodic'")
        if self.replay_tokens and self.policy != "none":
            raise IdentityError("state", f"{where}: replay_tokens needs policy 'none'")

    def encode_fields(self) -> list[Any]:
        return [getattr(self, name) for name in _FIELDS]

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, values: object) -> StateGroup:
        if isinstance(values, (list, tuple)) and len(values) == len(_FIELDS):
            values = dict(zip(_FIELDS, values))
        if not isinstance(values, dict):
            raise IdentityError("state", "each group must be a mapping")
        unknown = sorted(set(values) - set(_FIELDS), key=str)
        if unknown:
            raise IdentityError("state", f"{unknown[0]!r} is not a state group field")
        if "name" not in values or "kind" not in values:
            raise IdentityError("state", "each group needs a name and a kind")
        return cls(**values)


StateSpec = tuple[StateGroup, ...]


def check_spec(groups: StateSpec, block_tokens: int) -> None:
    """Raise IdentityError unless `groups` is a usable state spec."""
    if not isinstance(groups, tuple) or not all(isinstance(g, StateGroup) for g in groups):
        raise IdentityError("state", "must be a tuple of StateGroup")
    if not 1 <= len(groups) <= MAX_GROUPS:
        raise IdentityError("state", f"must name 1..{MAX_GROUPS} groups")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise IdentityError("state", "group names must be unique")
    for group in groups:
        group.check(block_tokens)


def spec_from_value(value: object) -> StateSpec | None:
    """A state spec from its wire or encoded form (a list of group mappings or field lists)."""
    if value is None:
        return None
    if isinstance(value, tuple) and all(isinstance(g, StateGroup) for g in value):
        return value
    if not isinstance(value, (list, tuple)):
        raise IdentityError("state", f"must be a list of groups, got {type(value).__name__}")
    return tuple(g if isinstance(g, StateGroup) else StateGroup.from_dict(g) for g in value)
