"""``nanoserve log show --owner ID``: one request's owners in the log, and what to say when none is there.

Owners are the engine's request ids: a client's id ``x`` as it sent it on a server without auth,
``<tenant>/x`` on a server with tenants (``--auth-token`` alone is tenant ``default``:
``nanoserve.service.tenants``), and ``<owner>#<i>`` for sample i of a parallel request (n, best_of).
A user who types the id their client sent finds nothing on a server with tenants, so a search that
finds nothing names the owners of that id it can see, or else how tenants' owners are named; in a log
without any tenant's owner (a server without auth) it says nothing of tenants.
"""

from __future__ import annotations

from nanoserve.service.tenants import SCOPE_SEPARATOR

SAMPLE_SEPARATOR = "#"  # <request_id>#<i>: sample i's owner (engine/core/sample_group.py)
MAX_NAMED_OWNERS = 5  # the tenant-scoped owners of an id named at most, in order found


def forked_children(
    url: str, pool_id: str | None, epoch: int | None, owner: str, from_seq: int, to_seq: int | None
) -> list[str]:
    """The owners a FORK of the epoch names ``owner`` the parent of (parallel sampling's samples), in order."""
    from nanoserve.allocator.log import Damage, scan_events

    children: list[str] = []
    scan = scan_events(url, pool_id, epoch, from_seq, to_seq, kind="fork")
    try:
        for item in scan:
            if not isinstance(item, Damage) and item.parent == owner and item.owner not in children:
                children.append(item.owner or "")
    finally:
        scan.close()
    return children


def tenant_owners(url: str, pool_id: str | None, epochs: list[int | None], request_id: str) -> tuple[list[str], bool]:
    """The owners ``<tenant>/<request_id>`` of the epochs' events (samples as their request), at most
    MAX_NAMED_OWNERS, in order found: where a user's ``request_id`` lives on a server with tenants; and
    whether any owner of the epochs is a tenant's. Reads every event of the epochs (only when a search
    found nothing)."""
    from nanoserve.allocator.log import Damage, scan_events

    suffix = SCOPE_SEPARATOR + request_id
    found: list[str] = []
    scoped = False
    for epoch in epochs:
        scan = scan_events(url, pool_id, epoch, 1, None)
        try:
            for item in scan:
                if isinstance(item, Damage) or item.owner is None:
                    continue
                request = item.owner.partition(SAMPLE_SEPARATOR)[0]
                scoped = scoped or SCOPE_SEPARATOR in request
                if request.endswith(suffix) and request not in found:
                    found.append(request)
                    if len(found) == MAX_NAMED_OWNERS:
                        return found, True
        finally:
            scan.close()
    return found, scoped


def tenant_hint(url: str, pool_id: str | None, epochs: list[int | None], owner: str) -> str | None:
    """The hint for an owner with no event: the tenant-scoped owners of that id found, else how they are
    named; None when no owner of the epochs is a tenant's (a server without auth: tenants are beside the point)."""
    found, scoped = tenant_owners(url, pool_id, epochs, owner.partition(SCOPE_SEPARATOR)[2] or owner)
    if not scoped:
        return None
    if found and SCOPE_SEPARATOR not in owner:
        return f"hint: a tenant's request is owned as <tenant>/<request_id>: found {', '.join(map(repr, found))}"
    return (
        f"hint: a tenant's request is owned as <tenant>/<request_id> where tenants are configured "
        f"('default/{owner.partition(SCOPE_SEPARATOR)[2] or owner}' with --auth-token), and sample i of "
        f"a parallel request as <owner>{SAMPLE_SEPARATOR}i; `nanoserve log requests` lists the request ids"
    )


def not_searched_line(url: str, pool_id: str) -> str | None:
    """The epochs of ``pool_id`` archived whole, which a search of the live log did not read, with their files."""
    from nanoserve.allocator.log.reader import archived_epoch_files, connect

    with connect(url) as conn:
        files = archived_epoch_files(conn, pool_id)
    if not files:
        return None
    named = ", ".join(f"epoch {epoch} in {path}" for epoch, path in files)
    return f"the archived epochs are not searched ({named}): read one with --url sqlite:///FILE"
