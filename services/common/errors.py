"""Domain errors and the gRPC status code each maps to.

Domain code raises these (it never imports grpc); the server's interceptor turns them into statuses, so a caller
gets INVALID_ARGUMENT with the field named instead of a stack trace.
"""

import grpc


class SlipstreamError(Exception):
    """Base of every domain error; `code` is the gRPC status a caller sees."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SlipstreamError):
    """Bad input. The message names the field and the fix."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(SlipstreamError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SlipstreamError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(SlipstreamError):
    """A cap is reached (backpressure); retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(SlipstreamError):
    """The caller may not ask for this (an address outside the operator's allowlist)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(SlipstreamError):
    """The request is valid but the system is not in a state to serve it (e.g. a step already committed)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(SlipstreamError):
    """A dependency (Redis, an engine, another service) cannot be reached right now."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SlipstreamError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class StartupError(SlipstreamError):
    """A service cannot start (busy port, unreachable Redis). The message says what to change."""


class RunStopped(SlipstreamError):
    """A service stopped the run on purpose (most of a step's rewards failed): the message is the one sentence a
    person needs, and the process exits with STOPPED."""

    code = grpc.StatusCode.FAILED_PRECONDITION


STOPPED = 3  # the exit code of a service that stopped the run with RunStopped
