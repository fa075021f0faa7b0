"""Reward models that run elsewhere: slime's remote_rm over HTTP, and any gRPC server implementing RewardService.

Calls are retried with exponential backoff; an item whose call still fails gets an error result, never a dead batch.
"""

import asyncio
import logging
import random

import grpc

from services.common.clients import PLAINTEXT, Credentials, open_aio_channel
from services.reward.isolation import Failure, RewardSample
from slipstream.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)


class Backoff:
    def __init__(self, retries: int, first_s: float):
        self.retries, self.first_s = retries, first_s

    async def attempts(self):
        """Yields attempt numbers, sleeping 2^n · first (with jitter, at most 30 s) between them."""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(self.first_s * 2 ** (attempt - 1), 30.0) * (1 + random.random() / 4))
            yield attempt


class HttpRewardModel:
    """POST {prompt, response, label} to `url`; the JSON answer is a number or a dict of components."""

    def __init__(self, url: str, backoff: Backoff, timeout_s: float):
        import httpx  # here: a fifth of a second of imports that a service without --rm-url need not pay

        self.url, self.backoff = url, backoff
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def score(self, sample: RewardSample):
        import httpx

        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        last = ""
        async for attempt in self.backoff.attempts():
            try:
                response = await self._client.post(self.url, json=payload)
                response.raise_for_status()
                return response.json()
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
                log.info("remote_rm %s attempt %d failed: %s", self.url, attempt + 1, last)
        return Failure("exception", f"remote reward model {self.url} failed {self.backoff.retries + 1} times: {last}")

    async def close(self) -> None:
        await self._client.aclose()


class GrpcRewardModel:
    """Any server implementing slipstream.v1.RewardService; items are sent in one Score call."""

    def __init__(self, address: str, backoff: Backoff, timeout_s: float, credentials: Credentials = PLAINTEXT):
        self.address, self.backoff, self.timeout_s = address, backoff, timeout_s
        # Retries are ours, with the backoff above.
        self._channel = open_aio_channel(address, credentials, max_attempts=1)
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)

    async def score_items(self, items: list[reward_pb2.RewardItem]) -> list[reward_pb2.RewardResult] | Failure:
        last = ""
        async for attempt in self.backoff.attempts():
            try:
                reply = await self._stub.Score(reward_pb2.ScoreRequest(items=items), timeout=self.timeout_s)
                if len(reply.results) != len(items):
                    return Failure("exception", f"{self.address} answered {len(reply.results)} of {len(items)} items")
                return list(reply.results)
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
                log.info("remote_grpc %s attempt %d failed: %s", self.address, attempt + 1, last)
        return Failure(
            "exception", f"remote reward service {self.address} failed {self.backoff.retries + 1} times: {last}"
        )

    async def close(self) -> None:
        await self._channel.close()
