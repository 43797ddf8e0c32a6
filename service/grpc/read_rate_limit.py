"""ReadRateInterceptor: a token bucket per peer for the calls that name a request by id.

Abort and Resume are cheap to send and, for an id that exists nowhere, cost
the server a registry check or a journal query each. A peer may make
``rate_per_s`` of them per second, in bursts of as many; beyond that a call is
refused with RESOURCE_EXHAUSTED and a ``google.rpc.RetryInfo`` saying when the
peer's bucket holds a token again. The refusal is held ``MIN_REFUSAL_HOLD_S``, or
until that time when it is later (at most ``MAX_REFUSAL_HOLD_S``), and answered
then, not at once: a client that ignores RetryInfo and calls again as soon as it
is refused would otherwise make the server answer as many refusals as it can
send (20,000 Aborts from 20 callers took the event loop, and with it the GIL,
from a running stream: 13-18% of its rate), and each answer costs the event loop
a whole call. Held, a peer gets its rate plus at most two refusals a second per
call it keeps in flight. The peer is the caller's tenant
where the server has auth (``AuthInterceptor`` runs first and sets ``CALLER``:
all of a tenant's tokens, certificates and connections share one bucket),
else the caller's ``authorization`` metadata when it carries one, else its
address.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from nanoserve.service.grpc.interceptors import CALLER, _replace_behavior, retry_status

# the methods counted: each names requests by id
RATE_LIMITED_METHODS = frozenset(
    {
        "/nanoserve.v1.GenerationService/Abort",
        "/nanoserve.v1.GenerationService/Resume",
        "/vllm.grpc.engine.VllmEngine/Abort",
    }
)
MAX_PEERS = 10_000  # buckets kept; the least recently used full ones go first
MIN_REFUSAL_HOLD_S = 0.5  # a refused call is held this long at least before its answer ...
MAX_REFUSAL_HOLD_S = 1.0  # ... and at most this long


@dataclass
class _Bucket:
    tokens: float
    updated_s: float  # time.monotonic() of the last refill


class TokenBuckets:
    """One bucket per peer: ``rate_per_s`` tokens a second, holding at most ``rate_per_s`` (the burst).

    Invariant: each bucket holds between 0 and ``burst`` tokens as of its
    ``updated_s``; at most MAX_PEERS buckets are kept (a dropped one was full or
    the oldest, and a peer starts again with a full bucket).
    """

    def __init__(self, rate_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate_per_s > 0:
            raise ValueError(f"max_read_calls_per_s must be > 0, got {rate_per_s}")
        self.rate_per_s = rate_per_s
        self.burst = max(1.0, rate_per_s)
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}  # peer -> its bucket, least recently used first

    def take(self, peer: str) -> float | None:
        """Takes one token from ``peer``'s bucket: None when it had one, else the seconds until it will."""
        now_s = self._clock()
        bucket = self._buckets.pop(peer, None)
        if bucket is None:
            bucket = _Bucket(self.burst, now_s)
            if len(self._buckets) >= MAX_PEERS:
                del self._buckets[next(iter(self._buckets))]
        bucket.tokens = min(self.burst, bucket.tokens + (now_s - bucket.updated_s) * self.rate_per_s)
        bucket.updated_s = now_s
        self._buckets[peer] = bucket  # most recently used last
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / self.rate_per_s


class ReadRateInterceptor(grpc.aio.ServerInterceptor):
    """Refuses Abort and Resume calls past a peer's rate (RESOURCE_EXHAUSTED with RetryInfo)."""

    def __init__(self, rate_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.buckets = TokenBuckets(rate_per_s, clock)
        self.num_refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None or details.method not in RATE_LIMITED_METHODS:
            return handler
        # the peer's address is known only inside the call: the bucket is taken there
        return _replace_behavior(
            handler, lambda behavior: self._unary(behavior, details), lambda behavior: self._stream(behavior, details)
        )

    async def _refusal(self, context: grpc.aio.ServicerContext[Any, Any], details: grpc.HandlerCallDetails) -> None:
        peer = _peer(context, details)
        retry_delay_s = self.buckets.take(peer)
        if retry_delay_s is None:
            return
        self.num_refused += 1
        held_s = min(max(retry_delay_s, MIN_REFUSAL_HOLD_S), MAX_REFUSAL_HOLD_S)
        await asyncio.sleep(held_s)  # answered when a retry could go through, not at once (module doc)
        retry_delay_s = max(0.0, retry_delay_s - held_s)
        who = "tenant" if CALLER.get().tenant else "peer"
        message = (
            f"{details.method.rsplit('/', 1)[-1]}: more than {self.buckets.rate_per_s:g} Abort/Resume calls per second "
            f"from this {who} (--max-read-calls-per-s); held {held_s:.3f} s, retry in {retry_delay_s:.3f} s"
        )
        await context.abort_with_status(retry_status(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_delay_s))

    def _unary(self, behavior: Callable[..., Any], details: grpc.HandlerCallDetails) -> Callable[..., Any]:
        async def limited(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await self._refusal(context, details)
            return await behavior(request, context)

        return limited

    def _stream(self, behavior: Callable[..., Any], details: grpc.HandlerCallDetails) -> Callable[..., Any]:
        async def limited(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await self._refusal(context, details)
            async for response in behavior(request, context):
                yield response

        return limited


def _peer(context: grpc.aio.ServicerContext[Any, Any], details: grpc.HandlerCallDetails) -> str:
    """The caller: its tenant (auth on), else its bearer token when it sends one, else its address
    without the port."""
    caller = CALLER.get()
    if caller.tenant:
        return "tenant:" + caller.tenant
    for key, value in details.invocation_metadata or ():
        if key == "authorization":
            token = value if isinstance(value, bytes) else value.encode()
            return "auth:" + hashlib.sha256(token).hexdigest()[:32]  # the secret itself is not kept
    address = context.peer()  # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", "unix:..."
    return address.rsplit(":", 1)[0] if address.startswith(("ipv4:", "ipv6:")) else address
