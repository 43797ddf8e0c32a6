"""Server interceptors: the one place domain errors become gRPC status codes, and auth.

``ErrorInterceptor`` wraps every unary and server-streaming method (and lets a servicer
hand over a response already serialized, as ``bytes``): a domain
error raised by a servicer (or by the engine it called) ends the call with the
status below and the error's message, which names the field and the limit.
A full waiting queue (RESOURCE_EXHAUSTED) also carries a ``google.rpc.RetryInfo``
detail in the ``grpc-status-details-bin`` trailer: that is what tells a client
it may retry, unlike gRPC's own RESOURCE_EXHAUSTED for an over-size message,
which has no detail. Anything else is a bug: it is logged with its traceback and the client gets
INTERNAL. ``AuthInterceptor`` resolves the caller's tenant and role from
``authorization: Bearer <token>`` on every method except the health service,
which load balancers probe without a token, and keeps clients off the operator
methods.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from nanoserve.allocator.log import LogDamagedError, LogNotFoundError, LogUnavailableError
from nanoserve.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EventLogNotDurableError,
    InvalidRequestError,
    JournalDisabledError,
    JournalGapError,
    PrefixCacheResetRefusedError,
    QueueFullError,
    RequestEndedAtRecoveryError,
    RequestNotFoundError,
    StreamBufferFullError,
)
from nanoserve.service.grpc import convert, vllm_convert
from nanoserve.service.grpc.errors import (
    EventLogDisabledError,
    KvEventsUnavailableError,
    SeqOutOfRangeError,
    UnimplementedError,
)
from nanoserve.service.tenants import ANONYMOUS, Identity, TenantTable

log = structlog.get_logger("nanoserve.service")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# the operator surfaces: a ``client`` gets PERMISSION_DENIED (docs/security.md)
ADMIN_METHODS: tuple[str, ...] = (
    "/nanoserve.v1.AllocationService/",  # GetPoolStatus, WatchEvents, Audit, ResetPrefixCache
    "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
    "/vllm.grpc.engine.VllmEngine/FlushCache",
)
# the identity of the call being served; the anonymous admin where no AuthInterceptor runs (no auth)
CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("nanoserve_caller", default=ANONYMOUS)

# domain error -> status code; the first matching class wins
STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StreamBufferFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),  # a client reading too slowly; no RetryInfo
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (EventLogNotDurableError, grpc.StatusCode.UNAVAILABLE),  # new requests while the log's store is away
    (LogUnavailableError, grpc.StatusCode.UNAVAILABLE),  # Audit / WatchEvents while the store is away
    (RequestNotFoundError, grpc.StatusCode.NOT_FOUND),
    (LogNotFoundError, grpc.StatusCode.NOT_FOUND),  # Audit of an epoch the log does not hold
    (LogDamagedError, grpc.StatusCode.DATA_LOSS),  # WatchEvents meeting a damaged record
    (JournalGapError, grpc.StatusCode.DATA_LOSS),  # Resume of a history across a damaged journal row
    (EventLogDisabledError, grpc.StatusCode.FAILED_PRECONDITION),
    (KvEventsUnavailableError, grpc.StatusCode.FAILED_PRECONDITION),  # a REGISTER logged without token ids
    (JournalDisabledError, grpc.StatusCode.FAILED_PRECONDITION),  # Resume without a journal
    (RequestEndedAtRecoveryError, grpc.StatusCode.FAILED_PRECONDITION),  # after its final output: why it ended
    (PrefixCacheResetRefusedError, grpc.StatusCode.FAILED_PRECONDITION),  # blocks held, or caching off
    (SeqOutOfRangeError, grpc.StatusCode.OUT_OF_RANGE),  # WatchEvents from past the next event
    (UnimplementedError, grpc.StatusCode.UNIMPLEMENTED),
)
# method prefix -> how that contract spells the engine's field names; the rest are nanoserve.v1's
FIELD_PATHS: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("/vllm.grpc.engine.VllmEngine/", vllm_convert.proto_field),
)
# The retry delay a full waiting queue advises (google.rpc.RetryInfo). A request leaves the
# queue when a running one finishes, a matter of the seconds one completion takes; the server
# cannot predict it, so this is a hint to start from and back off from on repeats.
QUEUE_FULL_RETRY_DELAY_S = 1.0


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code of a domain error; INTERNAL for anything else."""
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException, method: str = "") -> str:
    """The status message: an InvalidRequestError's engine field becomes the protobuf path of the
    contract ``method`` (``/package.Service/Method``) belongs to."""
    if isinstance(exc, InvalidRequestError):  # the engine names its own fields; the client knows the protobuf paths
        return f"{_field_path(exc.field, method)}: {str(exc).removeprefix(exc.field + ': ')}"
    # KeyError's str() wraps its message in quotes
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc) or type(exc).__name__


def _field_path(engine_field: str, method: str) -> str:
    for prefix, field_path in FIELD_PATHS:
        if method.startswith(prefix):
            return field_path(engine_field)
    return convert.proto_field(engine_field)


def retry_status(code: grpc.StatusCode, message: str, retry_delay_s: float) -> grpc.Status:
    """A status whose ``grpc-status-details-bin`` trailer holds a ``google.rpc.Status``
    with one ``google.rpc.RetryInfo(retry_delay)`` detail (google/rpc/error_details.proto)."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(round(retry_delay_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception, method: str) -> None:
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("rpc_failed", method=method, exc_info=exc)
        await context.abort(code, f"internal error ({type(exc).__name__}); see the server log")
    if isinstance(exc, QueueFullError):
        await context.abort_with_status(retry_status(code, message_for(exc, method), QUEUE_FULL_RETRY_DELAY_S))
    await context.abort(code, message_for(exc, method))


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method)

    return wrapper


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        # a coroutine that writes with context.write (grpc_health's Watch)
        return _wrap_unary(behavior, method)

    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method)

    return wrapper


def _passing_bytes(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """``serialize``, except that a response a servicer hands over as ``bytes`` goes out as it is:
    a message many callers get (a stored event, a journaled output) is serialized once and the same
    bytes are sent to each (``EventMessages``, ``ResumeMessages``)."""
    if serialize is None:
        return None

    def serialize_or_pass(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return serialize_or_pass


def _replace_behavior(
    handler: grpc.RpcMethodHandler[Any, Any],
    unary: Callable[[Callable[..., Any]], Callable[..., Any]],
    stream: Callable[[Callable[..., Any]], Callable[..., Any]],
    response_serializer: Callable[[Any], bytes] | None = None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler like ``handler`` whose unary_unary / unary_stream behavior is wrapped (and its
    response serializer replaced by ``response_serializer`` when given)."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": response_serializer or handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    assert handler.stream_stream is not None, f"method handler {handler!r} has no behavior"
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **kwargs)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain errors to status codes (``STATUS_BY_ERROR``) for every method."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        return _replace_behavior(
            handler,
            lambda b: _wrap_unary(b, method),
            lambda b: _wrap_stream(b, method),
            _passing_bytes(handler.response_serializer),
        )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Resolves each call's ``Identity`` through ``table``: from ``authorization: Bearer <token>``
    when the call carries it (a wrong token is refused, never passed over), else from the client
    certificate the TLS handshake verified (mutual TLS: its subject common name, ``cert`` lines of
    the tokens file). UNAUTHENTICATED without a known token or certificate (health stays open); a
    ``client`` is refused the operator methods (``ADMIN_METHODS``, PERMISSION_DENIED). The method
    runs with ``CALLER`` set, which is where servicers read the tenant: a tenant sent by the client
    is never trusted. ``table`` may be replaced at any time (SIGHUP reload); a call resolves its
    identity once, when it starts.
    """

    def __init__(self, table: TenantTable) -> None:
        self.table = table

    def identity(self, details: grpc.HandlerCallDetails) -> Identity | None:
        """The caller named by the call's bearer token; None without one or with an unknown one."""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if not given.startswith(b"Bearer "):
                    return None
                return self.table.lookup(given.removeprefix(b"Bearer "))
        return None

    def certificate_identity(self, context: grpc.aio.ServicerContext[Any, Any]) -> Identity | None:
        """The caller named by the verified client certificate's common name; None without one."""
        names = context.auth_context().get("x509_common_name") or ()
        for name in names:
            found = self.table.lookup_cert(name.decode(errors="replace"))
            if found is not None:
                return found
        return None

    def refusal(self, caller: Identity | None, method: str) -> tuple[grpc.StatusCode, str] | None:
        if caller is None:
            how = "'authorization: Bearer <token>' metadata"
            if self.table.num_certs:
                how += ", and no client certificate named in the tokens file"
            return grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {how}"
        if not caller.is_admin and is_admin_method(method):
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} needs role 'admin'; tenant {caller.tenant!r} has role '{caller.role.value}'",
            )
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        method = details.method
        caller = self.identity(details)
        if self.table.num_certs and not _carries_token(details):  # the certificate is known inside the call only
            return _replace_behavior(
                handler,
                lambda b: _as_certified_unary(b, self, method),
                lambda b: _as_certified_stream(b, self, method),
            )
        refused = self.refusal(caller, method)
        if refused is not None:
            return _refusal(handler, *refused)
        assert caller is not None
        return _replace_behavior(handler, lambda b: _as_caller_unary(b, caller), lambda b: _as_caller_stream(b, caller))


def is_admin_method(method: str) -> bool:
    """Whether ``method`` (``/package.Service/Method``) is an operator surface."""
    return any(method.startswith(prefix) for prefix in ADMIN_METHODS)


def _refusal(
    handler: grpc.RpcMethodHandler[Any, Any], code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler[Any, Any]:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message)

    return _replace_behavior(handler, lambda _: refuse, lambda _: refuse)


def _as_caller_unary(behavior: Callable[..., Awaitable[Any]], caller: Identity) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        CALLER.set(caller)  # each call runs in its own task, hence its own context
        return await behavior(request, context)

    return wrapper


def _carries_token(details: grpc.HandlerCallDetails) -> bool:
    """Whether the call sends ``authorization`` metadata (right or wrong, it then names the caller)."""
    return any(key == "authorization" for key, _ in details.invocation_metadata or ())


async def _set_certified_caller(
    auth: AuthInterceptor, method: str, context: grpc.aio.ServicerContext[Any, Any]
) -> None:
    """Sets ``CALLER`` to the call's certificate identity, or aborts the call (UNAUTHENTICATED or
    PERMISSION_DENIED)."""
    caller = auth.certificate_identity(context)
    refused = auth.refusal(caller, method)
    if refused is not None:
        await context.abort(*refused)
    assert caller is not None
    CALLER.set(caller)


def _as_certified_unary(
    behavior: Callable[..., Awaitable[Any]], auth: AuthInterceptor, method: str
) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await _set_certified_caller(auth, method, context)
        return await behavior(request, context)

    return wrapper


def _as_certified_stream(behavior: Callable[..., Any], auth: AuthInterceptor, method: str) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        return _as_certified_unary(behavior, auth, method)

    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        await _set_certified_caller(auth, method, context)
        async for response in behavior(request, context):
            yield response

    return wrapper


def _as_caller_stream(behavior: Callable[..., Any], caller: Identity) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        return _as_caller_unary(behavior, caller)

    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        CALLER.set(caller)
        async for response in behavior(request, context):
            yield response

    return wrapper


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Refuses new calls with UNAVAILABLE once ``draining`` is set; health stays open.

    During the shutdown grace the listener stays open (a client connecting then
    is told NOT_SERVING by health and UNAVAILABLE by any other method, instead of
    meeting a refused connection), while the calls already in flight finish.
    """

    MESSAGE = "the server is shutting down: new calls are refused; retry on another server"

    def __init__(self) -> None:
        self.draining = False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None or not self.draining or details.method.startswith(HEALTH_PREFIX):
            return handler

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.MESSAGE)

        return _replace_behavior(handler, lambda _: refuse, lambda _: refuse)
