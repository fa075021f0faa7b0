"""Trainer fixtures: a tiny checkpoint, and buffers already holding the generated groups of a few steps."""

import json
import random
import time

import pytest
import torch

from services.buffer.config import BufferConfig
from services.buffer.server import build as build_buffer
from services.train.tiny_checkpoint import write_tiny_model
from slipstream import samples
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc

NUM_STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("trainer-model"))


@pytest.fixture
def filled_buffer(grpc_service, channel_to, redis_url, model, tmp_path):
    """`filled_buffer(name)`: a buffer whose groups for NUM_STEPS steps are already generated (the same ones for
    the same name), as a rollout would leave them."""

    def make(name: str) -> str:
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"Count to {i}"}) + "\n" for i in range(2 * NUM_STEPS)))
        service = grpc_service(build_buffer, BufferConfig(
            prompt_data=str(data), hf_checkpoint=str(model), num_data_workers=0, num_epoch=1, rollout_batch_size=2,
            n_samples_per_prompt=2, max_staleness=100, redis={"url": redis_url, "prefix": f"{name}{time.time_ns()}"},
        ))  # fmt: skip
        buffer = buffer_pb2_grpc.BufferServiceStub(channel_to(service.address))
        for _ in range(2 * NUM_STEPS):
            (lease,) = buffer.LeasePrompts(buffer_pb2.LeasePromptsRequest(max_groups=1), timeout=30).leases
            buffer.SubmitGroup(buffer_pb2.SubmitGroupRequest(lease_id=lease.lease_id, group=generated(lease.group)))
        return service.address

    return make


def generated(group):
    rng = random.Random(group.group_id)
    prompt = samples.decode_tokens(group.prompt_tokens).tolist()
    for i in range(2):
        response = [rng.randrange(5, 400) for _ in range(rng.randrange(3, 9))]
        group.samples.add(
            sample_id=f"{group.group_id}/{i}", index=i, tokens=samples.encode_tokens(prompt + response),
            prompt_length=len(prompt), response_length=len(response), reward=float(i),
            loss_mask=samples.encode_mask([1] * len(response)),
            rollout_logprobs=samples.encode_logprobs([-1.0] * len(response)),
        )  # fmt: skip
    return group


def trainer_args(model, buffer: str, save, *extra: str) -> list[str]:
    """`slipstream trainer`'s command line for the tests (`save` None: no --save)."""
    return ["trainer", "--port", "0", "--metrics-port", "null", "--hf-checkpoint", str(model), "--buffer-addr", buffer,
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--lr", "1e-3",
            *(["--save", str(save)] if save else []), *extra]  # fmt: skip


def weights(folder, step: int, part: str = "model") -> dict:
    return torch.load(folder / f"iter_{step:07d}" / "mp_rank_00_000.pt", weights_only=False)[part]
