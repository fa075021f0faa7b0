"""Buffer fixtures: a real tokenizer, dataset files, and a `Buffer` on the session's real Redis."""

import json
import uuid
from pathlib import Path

import pytest

from services.buffer.config import BufferConfig
from services.buffer.core import Buffer
from services.buffer.server import build_streams
from services.buffer.store import BufferStore
from services.common.plugins import load_callable
from services.train.tiny_checkpoint import write_tokenizer
from slipstream import samples
from slipstream.v1 import common_pb2
from tests.redis_servers import (
    async_client,
    redis_url_on_both,  # noqa: F401  (the buffer's tests run on both Redis servers)
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    rows = [{"prompt": f"What is {i} + {i}?", "label": str(2 * i), "metadata": {"row": i}} for i in range(20)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


@pytest.fixture
async def make_buffer(redis_url, tokenizer_dir, prompts_file):
    """`await make_buffer(**config)`: a started Buffer on a fresh run namespace (same run_id → same state)."""
    clients, buffers = [], []

    async def make(**overrides) -> Buffer:
        settings = {
            "prompt_data": str(prompts_file),
            "hf_checkpoint": str(tokenizer_dir),
            "label_key": "label",
            "num_data_workers": 0,
            "rollout_batch_size": 4,
            "n_samples_per_prompt": 2,
            "run_id": "t" + uuid.uuid4().hex[:8],
            **overrides,
        }
        config = BufferConfig(**settings)
        client = async_client(redis_url)
        clients.append(client)
        filters = [
            load_callable(p) if p else None for p in (config.dynamic_sampling_filter_path, config.buffer_filter_path)
        ]
        buffer = Buffer(config, BufferStore(client, "test", config.run_id), build_streams(config, None), *filters)
        await buffer.start()
        buffers.append(buffer)
        return buffer

    yield make
    for buffer in buffers:
        await buffer.close()
    for client in clients:
        await client.aclose()


def finish(group: common_pb2.PromptGroup, rewards: list[float], version: int = 0, response_len: int = 3):
    """The group with one sample per reward, as a rollout worker would submit it."""
    done = common_pb2.PromptGroup()
    done.CopyFrom(group)
    del done.samples[:]
    prompt = samples.decode_tokens(group.prompt_tokens).tolist()
    for i, reward in enumerate(rewards):
        response = [7 + i] * response_len
        done.samples.append(
            common_pb2.Sample(
                sample_id=f"{group.group_id}/{i}",
                index=i,
                tokens=samples.encode_tokens(prompt + response),
                prompt_length=len(prompt),
                response_length=response_len,
                loss_mask=samples.encode_mask([1] * response_len),
                rollout_logprobs=samples.encode_logprobs([-0.5] * response_len),
                reward=reward,
                status=common_pb2.SAMPLE_STATUS_COMPLETED,
                weight_versions=[common_pb2.WeightVersionSpan(version=str(version), start=0, end=response_len)],
            )
        )
    return done
