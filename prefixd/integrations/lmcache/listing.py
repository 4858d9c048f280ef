"""LMCache's `list_l2_keys` over the daemon's listing of stored blocks, tenant (cache salt) by
tenant. The cursor is the tenant and the daemon's cursor within it, in hex: opaque to LMCache, and
never a raw key in a log.
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.distributed.api import ObjectKey

from prefixd.integrations.lmcache.identity import salt_of, split_key


def list_keys(
    link: Any, tenant: str, model_name: str | None, page_size: int, cursor: str | None
) -> tuple[list[tuple[ObjectKey, int]], str | None]:
    """Up to `page_size` (ObjectKey, size) of the adapter's stored keys, and the next cursor;
    RuntimeError when the daemon cannot be asked (LMCache reports it to its caller)."""
    tenants = _tenants(link, tenant)
    at, after = _parse(cursor)
    found: list[tuple[ObjectKey, int]] = []
    names = [t for t in tenants if at is None or t >= at]
    for name in names:
        salt = salt_of(tenant, name)
        assert salt is not None
        page_after = after if name == at else None
        while len(found) < page_size:
            want = min(4096, page_size - len(found))
            page = link.call(lambda c: c.list_blocks(tenant=name, after=page_after, limit=want))  # noqa: B023
            if page is None:
                raise RuntimeError("prefixd L2 adapter: the daemon did not answer a listing")
            blocks, page_after = page
            for block in blocks:
                if model_name is not None and block.identity.model != model_name:
                    continue
                chunk_hash, rank, group = split_key(block.tokens)
                key = ObjectKey(
                    chunk_hash=chunk_hash,
                    model_name=block.identity.model,
                    kv_rank=rank,
                    object_group_id=group,
                    cache_salt=salt,
                )
                found.append((key, block.size))
            if page_after is None:
                break
        if len(found) >= page_size:
            if page_after is not None:
                return found, _format(name, page_after)
            later = [t for t in names if t > name]
            return found, (_format(later[0], None) if later else None)
    return found, None


def _tenants(link: Any, tenant: str) -> list[str]:
    stats = link.call(lambda c: c.stats())
    if stats is None:
        raise RuntimeError("prefixd L2 adapter: the daemon did not answer a listing")
    names = stats.get("metrics", {}).get("tenants", {})
    return sorted(name for name in names if salt_of(tenant, name) is not None)


def _format(tenant: str, after: bytes | None) -> str:
    return tenant.encode().hex() + "." + (after.hex() if after else "")


def _parse(cursor: str | None) -> tuple[str | None, bytes | None]:
    if not cursor:
        return None, None
    try:
        name, _, after = cursor.partition(".")
        return bytes.fromhex(name).decode(), (bytes.fromhex(after) if after else None)
    except ValueError:
        raise ValueError("prefixd L2 adapter: a malformed listing cursor") from None


__all__ = ["list_keys"]
