"""The server interceptor every service runs: maps domain errors to gRPC status codes and records RPC metrics.

Servicer methods stay plain: they raise `SlipstreamError`s, and callers see the matching status with the message,
never a stack trace; anything unexpected becomes INTERNAL and is logged with the method name.
"""

import inspect
import logging
import time

import grpc
import redis

from services.common.errors import InvalidArgument, ResourceExhausted, SlipstreamError
from services.common.metrics import RPC_LATENCY, RPC_REQUESTS

log = logging.getLogger(__name__)

_HANDLER_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


_DOWNSTREAM_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _status_for(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SlipstreamError):
        return exc.code, str(exc)
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):  # the service's own Redis: its state
        return grpc.StatusCode.UNAVAILABLE, f"{method}: Redis does not answer ({exc}); the call can be retried"
    if isinstance(exc, grpc.RpcError) and exc.code() in _DOWNSTREAM_DOWN:  # a service it calls is down or hung
        message = f"{method}: a service it calls answered {exc.code().name}: {exc.details()}"
        log.warning("%s", message)
        return grpc.StatusCode.UNAVAILABLE, message
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented yet"
    log.exception("%s failed", method)
    return grpc.StatusCode.INTERNAL, f"{method} failed with {type(exc).__name__}: {exc} (see the service log)"


def _allow_bytes(serializer):
    """A servicer may answer with the response already serialized (bytes), when it holds the bytes anyway: the
    buffer assembles GetBatch responses from the groups' stored bytes instead of parsing and re-serializing them."""
    if serializer is None:
        return None
    return lambda response: response if isinstance(response, bytes) else serializer(response)


# Largest request each method takes, in MiB, checked on the bytes before they are parsed; a method not listed takes
# CONTROL_MIB, and None is the service's --max-message-mb (what gRPC itself enforces for every method).
REQUEST_MIB: dict[str, int | None] = {
    "SubmitGroup": None,  # a finished group: its samples' tokens, log-probs, multimodal data
    "Score": 64,  # a group's responses and labels
    "ScoreGroup": 64,
    "SyncWeightBuckets": 64,  # per bucket: tensor specs, and colocated, a handle per tensor and GPU
}
CONTROL_MIB = 4


class Refused:
    """A request not taken (too large, or not a valid message): the call is answered with `error`."""

    def __init__(self, error: SlipstreamError):
        self.error = error


def _guarded(deserializer, method: str, limit_mib: int | None):
    limit = None if limit_mib is None else limit_mib * 1024 * 1024

    def take(data: bytes):
        if limit is not None and len(data) > limit:
            return Refused(
                ResourceExhausted(
                    f"{method}: the request is {len(data):,} bytes, over this method's "
                    f"limit of {limit_mib} MiB; send less per call"
                )
            )
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError, or anything a malformed message raises
            return Refused(InvalidArgument("request", f"not a valid {method} request message ({e})"))

    return take


def _taken(request):
    if isinstance(request, Refused):
        raise request.error
    return request


async def _taken_stream(requests):
    async for request in requests:
        yield _taken(request)


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, service: str):
        self.service = service
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}  # each served method's wrapped handler, made once

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        wrapped = self._handlers.get(details.method)
        if wrapped is None:
            handler = await continuation(details)
            if handler is None:  # not a method of this server: not remembered, whatever names callers send
                return None
            wrapped = self._handlers[details.method] = self._wrap_handler(handler, details.method)
        return wrapped

    def _wrap_handler(self, handler: grpc.RpcMethodHandler, path: str) -> grpc.RpcMethodHandler:
        method = path.rsplit("/", 1)[-1]
        for kind, make_handler in _HANDLER_KINDS.items():
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                wrapped = self._wrap(behaviour, method, handler.request_streaming)
                serializer = _allow_bytes(handler.response_serializer)
                deserializer = handler.request_deserializer
                if deserializer is not None:
                    deserializer = _guarded(deserializer, method, REQUEST_MIB.get(method, CONTROL_MIB))
                return make_handler(wrapped, deserializer, serializer)
        return handler

    def _wrap(self, behaviour, method: str, streaming_requests: bool):
        take = _taken_stream if streaming_requests else _taken

        if inspect.isasyncgenfunction(behaviour):

            async def stream(request, context):
                start = time.perf_counter()
                try:
                    async for response in behaviour(take(request), context):
                        yield response
                except Exception as exc:
                    await self._fail(context, exc, method, start)
                self._record(method, context, start)

            return stream

        async def call(request, context):
            start = time.perf_counter()
            try:
                result = behaviour(take(request), context)
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:
                await self._fail(context, exc, method, start)
            self._record(method, context, start)
            return result

        return call

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception, method: str, start: float) -> None:
        if isinstance(exc, grpc.aio.AbortError):  # the servicer aborted with its own status
            self._record(method, context, start)
            raise exc
        code, message = _status_for(exc, method)
        self._record(method, context, start, code)
        await context.abort(code, message)

    def _record(self, method: str, context, start: float, code: grpc.StatusCode | None = None) -> None:
        code = code or context.code() or grpc.StatusCode.OK
        RPC_REQUESTS.labels(self.service, method, code.name).inc()
        RPC_LATENCY.labels(self.service, method).observe(time.perf_counter() - start)
