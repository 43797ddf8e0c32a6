"""ScopeBuffer: the unread outputs of all the streams of one request-id scope (a tenant), in bytes.

Each stream bounds what it holds for its reader (``--max-stream-buffer-bytes``),
but a tenant that opens many streams and reads none would hold that bound many
times over. So the streams of one scope (``scope_of``: the tenant of a server
that keeps tenants apart, ``tenant/id``) also share one byte bound,
``--max-tenant-stream-buffer-bytes``: past it the scope's stream holding the
most unread bytes is cut off (its request aborted, cause slow_consumer), the
laggard rather than whichever stream happened to produce the next token. The
engine only groups by the scope; it never learns what a tenant is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.engine.core.request_stream import RequestStream


class ScopeBuffer:
    """One scope's account (event loop only).

    Invariant: ``num_queued_bytes`` is the sum of ``num_queued_bytes`` over every
    stream that joined this account, open or finished, until its reader takes
    the outputs or the stream drops them; ``streams`` holds those not yet finished
    (only they can be cut off). The account is in its ``ScopeBuffers`` exactly
    while it has a stream open or bytes held.
    """

    def __init__(self, scope: str, accounts: dict[str, ScopeBuffer]) -> None:
        self.scope = scope
        self.num_queued_bytes = 0
        self.streams: set[RequestStream] = set()
        self._accounts = accounts  # the ScopeBuffers' map that holds this account

    def laggard(self) -> RequestStream | None:
        """The open stream holding the most unread bytes (None: no open stream holds any)."""
        holding = [stream for stream in self.streams if stream.num_queued_bytes > 0 and not stream.overflowed]
        return max(holding, key=lambda stream: stream.num_queued_bytes, default=None)

    def release(self, num_bytes: int) -> None:
        """A stream's reader took, or the stream dropped, outputs of ``num_bytes``."""
        self.num_queued_bytes -= num_bytes
        self._drop_if_idle()

    def leave(self, stream: RequestStream) -> None:
        """``stream`` finished: it can no longer be cut off (its bytes count until read)."""
        self.streams.discard(stream)
        self._drop_if_idle()

    def _drop_if_idle(self) -> None:
        if not self.streams and self.num_queued_bytes == 0 and self._accounts.get(self.scope) is self:
            del self._accounts[self.scope]


class ScopeBuffers:
    """scope -> its ``ScopeBuffer``, kept only while it has a stream open or bytes held."""

    def __init__(self) -> None:
        self._accounts: dict[str, ScopeBuffer] = {}  # scope -> account

    def join(self, scope: str, stream: RequestStream) -> ScopeBuffer:
        """``stream``'s account: the scope's, made on its first stream."""
        account = self._accounts.get(scope)
        if account is None:
            account = self._accounts[scope] = ScopeBuffer(scope, self._accounts)
        account.streams.add(stream)
        return account

    def num_queued_bytes(self, scope: str) -> int:
        """The unread bytes the scope's streams hold now (0 for a scope with none)."""
        account = self._accounts.get(scope)
        return 0 if account is None else account.num_queued_bytes

    def __len__(self) -> int:
        return len(self._accounts)
