"""The server interceptor every service runs: maps domain errors to gRPC status codes and records RPC metrics.

Servicer methods stay plain: they raise `SlipstreamError`s, and callers see the matching status with the message,
never a stack trace; anything unexpected becomes INTERNAL and is logged with the method name.
"""

import inspect
import logging
import time

import grpc

from services.common.errors import SlipstreamError
from services.common.metrics import RPC_LATENCY, RPC_REQUESTS

log = logging.getLogger(__name__)

_HANDLER_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _status_for(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SlipstreamError):
        return exc.code, str(exc)
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


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, service: str):
        self.service = service

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        for kind, make_handler in _HANDLER_KINDS.items():
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                wrapped = self._wrap(behaviour, method)
                serializer = _allow_bytes(handler.response_serializer)
                return make_handler(wrapped, handler.request_deserializer, serializer)
        return handler

    def _wrap(self, behaviour, method: str):
        if inspect.isasyncgenfunction(behaviour):

            async def stream(request, context):
                start = time.perf_counter()
                try:
                    async for response in behaviour(request, context):
                        yield response
                except Exception as exc:
                    await self._fail(context, exc, method, start)
                self._record(method, context, start)

            return stream

        async def call(request, context):
            start = time.perf_counter()
            try:
                result = behaviour(request, context)
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
