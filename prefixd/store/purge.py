"""Which entries a purge removes, and the purge: one write transaction, so they are unreachable at
once while reads in flight finish on their own snapshot."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import lmdb

from prefixd.errors import ConfigError
from prefixd.schema.identity import Identity
from prefixd.schema.records import AccessRecord
from prefixd.store import counters
from prefixd.store.removal import remove_subtree
from prefixd.store.scrub import ClearReport, clear, tree_pages
from prefixd.store.tables import Tables, readable_identities, stored_record

if TYPE_CHECKING:
    from prefixd.store.access import AccessTimes
    from prefixd.store.context import StoreContext

log = logging.getLogger(__name__)

# Identity fields whose version a model retirement may keep ("--except-weights V" and the like).
MAX_OLDER_THAN_S = 1e11  # some 3,000 years; not NaN, not infinite (its cutoff is an int of ns)
VERSIONED_FIELDS = ("weights", "tokenizer", "template", "adapter", "mm", "rope", "kv_layout")


@dataclass(frozen=True)
class PurgeSelector:
    """What to remove; criteria combine with AND, `everything` alone selects all. `keep={"weights":
    "v7"}` with `model` retires every version but that one. `older_than_s`: only blocks not read for
    that long (lookups touch all ancestors, so idle blocks form whole subtrees)."""

    tenant: str | None = None
    model: str | None = None
    keep: Mapping[str, str | None] = field(default_factory=dict)
    older_than_s: float | None = None
    everything: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.keep) - set(VERSIONED_FIELDS))
        if unknown:
            raise ConfigError(f"purge: cannot keep a version of {unknown[0]!r}")
        if self.keep and self.model is None:
            raise ConfigError("purge: keeping a version needs --model")
        if self.older_than_s is not None and not 0 <= self.older_than_s <= MAX_OLDER_THAN_S:
            raise ConfigError(f"purge: older_than must be from 0 to {MAX_OLDER_THAN_S:g} seconds")
        narrowed = (
            self.tenant is not None or self.model is not None or self.older_than_s is not None
        )
        if self.everything == narrowed:
            raise ConfigError(
                "purge: name what to remove (tenant, model, older than) or everything, not both"
            )

    def selects(self, identity: Identity) -> bool:
        if self.everything:
            return True
        if self.tenant is not None and identity.tenant != self.tenant:
            return False
        if self.model is not None and identity.model != self.model:
            return False
        return not any(getattr(identity, name) == kept for name, kept in self.keep.items())

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"keep": dict(self.keep)}

    @property
    def names_a_tenant(self) -> bool:
        """A purge of a tenant (or of everything) always clears the files after it; a retirement or
        an idle-time purge only with `scrub_retired`."""
        return self.tenant is not None or self.everything

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PurgeSelector:
        """From the wire form (describe()'s keys); ConfigError naming a bad field."""
        checks = {
            "tenant": (str, type(None)),
            "model": (str, type(None)),
            "keep": (dict,),
            "older_than_s": (int, float, type(None)),
            "everything": (bool,),
        }
        unknown = sorted(set(values) - set(checks))
        if unknown:
            raise ConfigError(f"purge: unknown field {unknown[0]!r}")
        for name, kinds in checks.items():
            value = values.get(name)
            if name in values and (
                not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
            ):
                raise ConfigError(f"purge: field {name!r} has the wrong type")
        keep = values.get("keep") or {}
        if not all(isinstance(v, (str, type(None))) for v in keep.values()):
            raise ConfigError("purge: kept versions must be strings")
        return cls(**{**values, "keep": dict(keep)})


@dataclass(frozen=True)
class PurgeReport:
    identities: int
    blocks: int
    payload_bytes: int
    stored_bytes: int
    dry_run: bool
    seconds: float
    # the identities removed whole (not for an idle-time purge): a shared tier drops their
    # objects too
    removed: tuple[Identity, ...] = ()
    # the criteria ("tenant", "model", "keep") that name nothing the store holds: a purge of a
    # tenant or model that is not there (a typo) says so instead of reporting zeros, and one
    # keeping a version no identity holds removes nothing
    unknown: tuple[str, ...] = ()
    # how the store's files were cleared after it (prefixd.store.scrub); None: they were not
    cleared: ClearReport | None = None

    def describe(self) -> dict[str, Any]:
        described = {k: v for k, v in vars(self).items() if k not in ("removed", "cleared")}
        described["unknown"] = list(self.unknown)
        described["cleared"] = None if self.cleared is None else self.cleared.describe()
        return described


def purge(
    ctx: StoreContext,
    access: AccessTimes,
    selector: PurgeSelector,
    *,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    keep_known: bool = False,
) -> PurgeReport:
    """Remove what `selector` names in one write transaction (a dry run only counts), then clear
    the store's files of it (prefixd.store.scrub) for a tenant's purge, or any with
    `scrub_retired`. `progress` is told how many root blocks each step handled. `keep_known`
    (an operator's purge): a version to keep that no identity of the model holds is a typo that
    would retire every version, the one in use too, so nothing is removed (`unknown`: keep)."""
    started = time.perf_counter()
    if selector.older_than_s is not None and not dry_run:
        access.sync()  # access times still in memory count
    t = ctx.tables
    whole = selector.older_than_s is None  # whole identities go, not idle subtrees
    cutoff = ctx.clock.time_ns() - int((selector.older_than_s or 0) * 1e9)
    reason = "retired" if selector.model is not None else "purged"
    scrub = not dry_run and (selector.names_a_tenant or ctx.config.scrub_retired)
    pages = tree_pages(ctx.env, t) if scrub else 0
    begin = ctx.env.begin(buffers=True) if dry_run else ctx.writing()
    with begin as txn:
        selected = selected_identities(txn, t, selector)
        unknown = unkept(txn, t, selector) if keep_known else ()
        digests = [] if unknown else list(selected)
        unknown = unknown or (() if digests else unknown_names(txn, t, selector))
        if whole:
            roots = [child for d in digests for child in children_of(txn, t, d)]
        else:
            roots = idle_blocks(txn, t, set(digests), cutoff)
        before = counters.read_all(txn, t.counters)
        if dry_run:
            blocks, payload, stored = subtree_totals(txn, t, roots)
        else:
            reported = 0
            for n, root in enumerate(roots, 1):
                remove_subtree(ctx, txn, root, reason=reason)
                if progress is not None and (n % 1024 == 0 or n == len(roots)):
                    progress(n - reported)
                    reported = n
            if whole:
                for digest in digests:
                    txn.delete(digest, db=t.identities)
            after = counters.read_all(txn, t.counters)
            blocks, payload, stored = (
                before[name] - after[name]
                for name in (counters.BLOCKS, counters.PAYLOAD_BYTES, counters.STORED_BYTES)
            )
    if whole and not dry_run:  # committed: nothing of them stays in memory either
        ctx.memo.forget_identities(set(digests), after[counters.REMOVALS])
        ctx.tenants.forget(digests)
    identities = len(digests) if whole else 0
    if not dry_run and blocks:
        log.info("purged %d block(s) of %d identity(ies)", blocks, identities)
    cleared = clear(ctx, pages) if scrub else None
    return PurgeReport(
        identities,
        blocks,
        payload,
        stored,
        dry_run,
        round(time.perf_counter() - started, 6),
        tuple(selected.values()) if whole and not dry_run else (),
        unknown,
        cleared,
    )


def selected_identities(
    txn: lmdb.Transaction, t: Tables, selector: PurgeSelector
) -> dict[bytes, Identity]:
    return {
        digest: identity
        for digest, identity in readable_identities(txn, t)
        if selector.selects(identity)
    }


def unkept(txn: lmdb.Transaction, t: Tables, selector: PurgeSelector) -> tuple[str, ...]:
    """("keep",) when a version the selector keeps is held by no identity of its model (and
    tenant); () when it keeps none, or the model is not there (unknown_names says so)."""
    held = [
        identity
        for _, identity in readable_identities(txn, t)
        if identity.model == selector.model and selector.tenant in (None, identity.tenant)
    ]
    for name, kept in selector.keep.items():
        if held and not any(getattr(identity, name) == kept for identity in held):
            return ("keep",)
    return ()


def unknown_names(txn: lmdb.Transaction, t: Tables, selector: PurgeSelector) -> tuple[str, ...]:
    """Which of the selector's tenant and model the store holds no identity of, so a typo is
    reported instead of zeros."""
    found = [identity for _, identity in readable_identities(txn, t)]
    tenant, model = selector.tenant, selector.model
    if tenant is not None and all(identity.tenant != tenant for identity in found):
        return ("tenant",)  # a model of a tenant that is not there is not worth naming
    if model is not None and not any(
        identity.model == model and tenant in (None, identity.tenant) for identity in found
    ):
        return ("model",)
    return ()


def children_of(txn: lmdb.Transaction, t: Tables, key: bytes) -> list[bytes]:
    cursor = txn.cursor(db=t.children)
    if not cursor.set_key(key):
        return []
    return [bytes(child) for child in cursor.iternext_dup()]


def idle_blocks(
    txn: lmdb.Transaction, t: Tables, digests: set[bytes], cutoff_ns: int
) -> list[bytes]:
    idle = []
    for key, value in txn.cursor(db=t.access):
        if AccessRecord.read(bytes(value), 0).last_ns >= cutoff_ns:
            continue
        record = stored_record(txn, t, bytes(key))
        if record is not None and record.identity in digests:
            idle.append(bytes(key))
    return idle


def subtree_totals(txn: lmdb.Transaction, t: Tables, roots: list[bytes]) -> tuple[int, int, int]:
    seen: set[bytes] = set()
    blocks = payload = stored = 0
    stack = list(roots)
    while stack:
        h = stack.pop()
        if h in seen:
            continue
        seen.add(h)
        record = stored_record(txn, t, h)
        if record is None:
            continue
        blocks += 1
        payload += record.payload_size
        stored += record.stored_size
        stack.extend(children_of(txn, t, h))
    return blocks, payload, stored
