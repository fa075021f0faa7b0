"""Bearer tokens with roles: who may call which RPC.

A token file holds `role token` lines. Servers check the `authorization: Bearer <token>` metadata of every call
(health and reflection excepted) against it; clients send the token of the role the call needs. The roles:

- `worker`: rollout workers: lease and submit prompts, score samples;
- `trainer`: takes batches, commits steps, rewinds on resume, drives the weight sync;
- `admin`: everything (operators and `slipstream train`), the only role that registers engines or stops the trainer.

Reading state (buffer state, engine list, trainer status, reward functions) is open to every role.
"""

import collections
import hmac
import logging
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import prometheus_client

from services.common.errors import StartupError

log = logging.getLogger(__name__)

ROLES = ("worker", "trainer", "admin")
MIN_TOKEN_CHARS = 16
V1 = "/slipstream.v1."
# The roles besides admin that may call each RPC (a method missing here is admin's only).
CALLERS: dict[str, tuple[str, ...]] = {
    **{f"{V1}BufferService/{m}": ("worker",) for m in ("LeasePrompts", "ExtendLease", "ReleaseLease", "SubmitGroup")},
    **{f"{V1}BufferService/{m}": ("trainer",) for m in ("GetBatch", "CommitBatch", "SetPolicyVersion", "Rewind")},
    **{f"{V1}RewardService/{m}": ("worker",) for m in ("Score", "ScoreGroup")},
    **{f"{V1}RolloutService/{m}": ("trainer",) for m in (
        "PrepareWeightSync", "SyncWeightBuckets", "CommitWeightSync", "AbortWeightSync", "ReleaseEngineMemory",
        "StartRollout", "StopRollout", "Evaluate")},
    **{method: ("worker", "trainer") for method in (
        f"{V1}BufferService/GetState", f"{V1}RewardService/ListRewardFunctions", f"{V1}RolloutService/ListEngines",
        f"{V1}TrainerService/GetStatus")},
}  # fmt: skip
OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes and tooling need no token

REFUSED = prometheus_client.Counter(
    "slipstream_rpc_refused", "RPCs refused for their token, by service, method and code", ["service", "method", "code"]
)


def file_stamp(path: Path) -> tuple:
    """What changes when a file is rewritten or replaced (a Kubernetes Secret swaps a symlink: a new inode)."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


class TokenFile:
    """The roles' tokens, re-read when the file changes (a rotated Secret takes effect without a restart)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._stamp: tuple | None = None
        self._tokens: list[tuple[str, str]] = []  # (role, token)
        self._load()

    def _load(self) -> None:
        try:
            stamp = file_stamp(self.path)
            if stamp == self._stamp:
                return
            text = self.path.read_text()
        except OSError as e:
            if self._stamp is None:
                raise StartupError(f"--auth-token-file {self.path}: {e.strerror}") from None
            return  # mid-rotation: keep the tokens read last
        self._tokens = parse_tokens(text, self.path)
        self._stamp = stamp

    def role_of(self, token: str) -> str | None:
        self._load()
        role = None
        for known_role, known in self._tokens:  # compare with every token, in constant time each
            if hmac.compare_digest(known.encode(), token.encode()):
                role = known_role
        return role

    def token_for(self, role: str) -> str:
        """The token a call needing `role` sends: that role's, else admin's (admin may call everything)."""
        self._load()
        for wanted in (role, "admin"):
            token = next((t for r, t in self._tokens if r == wanted), None)
            if token is not None:
                return token
        raise StartupError(
            f"--auth-token-file {self.path} has no token of role {role!r} (or admin), which this "
            f"service's calls need; add a line `{role} <token>`"
        )


def parse_tokens(text: str, path: Path) -> list[tuple[str, str]]:
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--auth-token-file {path}, line {number}"
        if len(words) != 2 or words[0] not in ROLES:
            raise StartupError(f"{where}: expected `role token` with role one of {', '.join(ROLES)}")
        if len(words[1]) < MIN_TOKEN_CHARS:
            raise StartupError(
                f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters; use a random one "
                "such as `openssl rand -hex 32` gives"
            )
        tokens.append((words[0], words[1]))
    if not tokens:
        raise StartupError(f"--auth-token-file {path} holds no `role token` line")
    return tokens


def allowed(role: str, method: str) -> bool:
    return role == "admin" or role in CALLERS.get(method, ())


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call without a valid token (UNAUTHENTICATED) or whose role may not call it (PERMISSION_DENIED)."""

    def __init__(self, service: str, tokens: TokenFile):
        self.service, self.tokens = service, tokens

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN):
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization", "")
        scheme, _, token = header.partition(" ")
        role = self.tokens.role_of(token.strip()) if scheme.lower() == "bearer" else None
        if role is None:
            why = "no token" if not header else "an unknown token" if scheme.lower() == "bearer" else "no Bearer token"
            message = (
                f"{details.method} needs `authorization: Bearer <token>` metadata with a token of the run's "
                f"--auth-token-file; the call had {why}"
            )
            return self._refuse(handler, details.method, grpc.StatusCode.UNAUTHENTICATED, message)
        if not allowed(role, details.method):
            roles = " or ".join((*CALLERS.get(details.method, ()), "admin"))
            message = f"{details.method} may be called by the {roles} role, not {role}"
            return self._refuse(handler, details.method, grpc.StatusCode.PERMISSION_DENIED, message)
        return handler

    def _refuse(self, handler, method: str, code: grpc.StatusCode, message: str):
        async def refuse(request, context: grpc.aio.ServicerContext):
            log.warning("refused %s from %s: %s", method, context.peer(), message)
            REFUSED.labels(self.service, method.rsplit("/", 1)[-1], code.name).inc()
            await context.abort(code, message)

        kind = (
            ("stream" if handler.request_streaming else "unary")
            + "_"
            + ("stream" if handler.response_streaming else "unary")
        )
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(refuse, handler.request_deserializer, handler.response_serializer)


class _SyncDetails(
    collections.namedtuple("_SyncDetails", "method timeout metadata credentials wait_for_ready compression"),
    grpc.ClientCallDetails,
):
    pass


def _with_token(details, pair: tuple[str, str]):
    metadata = [*(details.metadata or ()), pair]
    if isinstance(details, grpc.aio.ClientCallDetails):
        return details._replace(metadata=grpc.aio.Metadata(*metadata))
    fields = {name: getattr(details, name, None) for name in _SyncDetails._fields}
    return _SyncDetails(**{**fields, "metadata": metadata})


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a blocking channel: the token of `role` in the file as it
    is at the call (a rotated file is used from the next call on)."""

    def __init__(self, tokens: TokenFile, role: str):
        tokens.token_for(role)  # a missing role is a startup error, not a failed call later
        self.tokens, self.role = tokens, role

    @property
    def pair(self) -> tuple[str, str]:
        return ("authorization", f"Bearer {self.tokens.token_for(self.role)}")

    def intercept_unary_unary(self, continuation: Callable, details, request):
        return continuation(_with_token(details, self.pair), request)

    intercept_unary_stream = intercept_unary_unary
    intercept_stream_unary = intercept_unary_unary
    intercept_stream_stream = intercept_unary_unary


class _AioBearerToken:
    """The same for an asyncio channel, which takes one interceptor per kind of call (grpc.aio files an interceptor
    under the first kind it implements only): `aio_bearer_tokens` makes the four."""

    __init__ = BearerToken.__init__
    pair = BearerToken.pair

    async def _intercept(self, continuation: Callable, details, request):
        return await continuation(_with_token(details, self.pair), request)

    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _intercept


def aio_bearer_tokens(tokens: TokenFile, role: str) -> list:
    kinds = (
        grpc.aio.UnaryUnaryClientInterceptor,
        grpc.aio.UnaryStreamClientInterceptor,
        grpc.aio.StreamUnaryClientInterceptor,
        grpc.aio.StreamStreamClientInterceptor,
    )
    return [type(f"AioBearerToken{kind.__name__}", (_AioBearerToken, kind), {})(tokens, role) for kind in kinds]
