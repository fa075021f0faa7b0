"""Every RPC of every service fuzzed, on real service processes sharing a real Redis: request messages generated
from their descriptors (any value of any field, nested messages, lists, maps), and raw bytes (random, and valid
messages cut short). Each answer is success or a well-formed error, never INTERNAL; each service is still SERVING
afterwards, and the buffer's state in Redis still passes its invariants check."""

import asyncio
import json
import os

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from services.buffer.store import BufferStore
from services.common.clients import wait_until_serving
from services.common.processes import free_port
from services.train.tiny_checkpoint import write_tiny_model
from slipstream.v1 import buffer_pb2, reward_pb2, rollout_pb2, trainer_pb2
from tests.conftest import ServiceProcess
from tests.trainer.conftest import trainer_args

MODULES = {"buffer": buffer_pb2, "reward": reward_pb2, "rollout": rollout_pb2, "trainer": trainer_pb2}
WELL_FORMED = {c for c in grpc.StatusCode} - {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                               grpc.StatusCode.UNIMPLEMENTED}  # fmt: skip
LAST = {"/slipstream.v1.TrainerService/Stop"}  # a valid request ends the trainer: called last, on its own
# The trainer's own moves of the run (a policy version of 4 billion, a rewind to step 131,623): a live trainer is right
# to stop on its next step after them, so they are fuzzed once it has stopped.
TRAINERS_OWN = {"/slipstream.v1.BufferService/SetPolicyVersion", "/slipstream.v1.BufferService/Rewind"}
EXAMPLES = int(os.environ.get("SLIPSTREAM_FUZZ_EXAMPLES", "12"))
# Valid requests of these take seconds each (a checkpoint written, a batch waited for): a third of the examples.
COSTLY = {"/slipstream.v1.TrainerService/SaveCheckpoint", "/slipstream.v1.BufferService/GetBatch"}
RUN_ID = "fuzz"

INT = {32: st.integers(-(2**31), 2**31 - 1), 64: st.integers(-(2**63), 2**63 - 1)}
SCALARS = {
    F.TYPE_INT32: INT[32], F.TYPE_SINT32: INT[32], F.TYPE_SFIXED32: INT[32],
    F.TYPE_INT64: INT[64], F.TYPE_SINT64: INT[64], F.TYPE_SFIXED64: INT[64],
    F.TYPE_UINT32: st.integers(0, 2**32 - 1), F.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    F.TYPE_UINT64: st.integers(0, 2**64 - 1), F.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    F.TYPE_DOUBLE: st.floats(), F.TYPE_FLOAT: st.floats(width=32), F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: st.text(max_size=40), F.TYPE_BYTES: st.binary(max_size=64),
}  # fmt: skip


def values(field, depth: int):
    """Any value of one field (a list for a repeated one, a dict for a map)."""
    if field.type == F.TYPE_ENUM:
        one = st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-3, 40)
    elif field.type == F.TYPE_MESSAGE:
        entry = field.message_type.GetOptions().map_entry
        if entry:
            key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
            return st.dictionaries(values(key, depth), values(value, depth + 1), max_size=3)
        one = messages(field.message_type, depth + 1)
    else:
        one = SCALARS[field.type]
    return st.lists(one, max_size=3) if field.is_repeated else one


def messages(descriptor, depth: int = 0):
    """Any message of `descriptor`'s type: each field set or not, nested messages down to depth 3."""
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    fields = {f.name: values(f, depth) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda chosen: build(cls, chosen))


def build(cls, chosen: dict):
    message = cls()
    for name, value in chosen.items():
        field, target = cls.DESCRIPTOR.fields_by_name[name], getattr(message, name)
        if isinstance(value, dict):
            for key, item in value.items():
                if field.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif isinstance(value, list):
            target.extend(value)
        elif field.type == F.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def rpcs():
    for name, module in MODULES.items():
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield name, f"/{service.full_name}/{method.name}", method


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """Buffer, reward service, gateway (with a reference engine it launches) and trainer, each its own process."""
    folder = tmp_path_factory.mktemp("fuzz")
    model = write_tiny_model(folder / "model")
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}", "label": str(i)}) + "\n" for i in range(40)))
    yield folder, model, data


@pytest.fixture(scope="module")
def services(system, redis_url):
    folder, model, data = system
    ports = {name: free_port() for name in MODULES}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    common = ["--host", "127.0.0.1", "--metrics-port", "null"]
    prefix = f"fuzz{os.getpid()}"
    commands = {
        "buffer": ["buffer", "--port", str(ports["buffer"]), *common, "--redis-url", redis_url, "--redis-prefix",
                   prefix, "--run-id", RUN_ID, "--prompt-data", str(data), "--hf-checkpoint", str(model),
                   "--label-key", "label", "--num-data-workers", "0", "--rollout-batch-size", "2",
                   "--n-samples-per-prompt", "2"],
        "reward": ["reward", "--port", str(ports["reward"]), *common],
        "rollout": ["rollout", "--port", str(ports["rollout"]), *common, "--buffer-addr", addr["buffer"],
                    "--reward-addr", addr["reward"], "--hf-checkpoint", str(model), "--rollout-num-gpus", "1",
                    "--engine-log-dir", str(folder), "--weight-sync-timeout-s", "2", "--rollout-max-response-len",
                    "8", "--rm-type", "random"],
        "trainer": [*trainer_args(model, addr["buffer"], folder / "checkpoints"), *common],
    }  # fmt: skip
    commands["trainer"][commands["trainer"].index("--port") + 1] = str(ports["trainer"])
    procs = {}
    try:
        for name, command in commands.items():
            procs[name] = ServiceProcess(command, folder / f"{name}.log", folder)
            wait_until_serving(addr[name], timeout_s=180)
        yield addr, procs, (redis_url, prefix)
    finally:
        for proc in procs.values():
            proc.stop()


def call(address: str, method: str, payload: bytes) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        rpc = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            rpc(payload, timeout=3)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            assert e.code() in WELL_FORMED, f"{method}: {e.code().name}: {e.details()}"
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or e.details(), f"{method}: no message"
            return e.code()


def stream_call(address: str, method: str, payloads: list[bytes]) -> None:
    with grpc.insecure_channel(address) as channel:
        rpc = channel.stream_stream(method, request_serializer=None, response_deserializer=None)
        try:
            for _ in rpc(iter(payloads), timeout=3):
                pass
        except grpc.RpcError as e:
            assert e.code() in WELL_FORMED, f"{method}: {e.code().name}: {e.details()}"


def send(address: str, method, full_name: str, payloads: list[bytes]) -> None:
    if method.client_streaming:
        stream_call(address, full_name, payloads)
    else:
        for payload in payloads:
            call(address, full_name, payload)


def still_serving(services_, name: str) -> None:
    addr, procs, _ = services_
    assert procs[name].proc.poll() is None, procs[name].log[-3000:]
    wait_until_serving(addr[name], timeout_s=30)


FUZZED = [(n, full, m) for n, full, m in rpcs() if full not in LAST | TRAINERS_OWN]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, full_name, method", FUZZED, ids=[f.rsplit("/", 1)[1] for _, f, _ in FUZZED])
def test_generated_requests_get_success_or_a_well_formed_error(services, name, full_name, method):
    fuzz(services, name, full_name, method)


def fuzz(services, name: str, full_name: str, method) -> None:
    address = services[0][name]
    examples = max(1, EXAMPLES // 3) if full_name in COSTLY else EXAMPLES

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.lists(messages(method.input_type), min_size=1, max_size=2))
    def check(requests):
        send(address, method, full_name, [r.SerializeToString() for r in requests])

    check()
    still_serving(services, name)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, full_name, method", list(rpcs()), ids=[f.rsplit("/", 1)[1] for _, f, _ in rpcs()])
def test_random_and_truncated_bytes_get_success_or_a_well_formed_error(services, name, full_name, method):
    """Bytes that do not parse are INVALID_ARGUMENT (the interceptor), never gRPC's INTERNAL 'Exception
    deserializing request'; bytes that happen to parse are a request like any other."""
    address = services[0][name]
    # Not a message; a length-delimited field cut short; a varint cut short; random bytes.
    garbage = [b"\xff\xff\xff", b"\x0a\x10short", b"\x08\xff", bytes(range(7, 40))]
    if full_name in LAST | TRAINERS_OWN:  # only bytes that do not parse: valid ones would end the trainer
        garbage = [b"\xff\xff\xff", b"\x0a\x10short"]
    for payload in garbage:
        if method.client_streaming:
            stream_call(address, full_name, [payload])
        else:
            code = call(address, full_name, payload)
            if payload in (b"\xff\xff\xff", b"\x0a\x10short"):
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (full_name, code)
    still_serving(services, name)


def test_after_the_fuzzing_the_buffers_state_keeps_its_invariants_and_the_trainer_stops_cleanly(services):
    addr, procs, (redis_url, prefix) = services
    for name in MODULES:
        still_serving(services, name)

    async def violations():
        redis = Redis.from_url(redis_url)
        try:
            return await BufferStore(redis, prefix, RUN_ID).violations()
        finally:
            await redis.aclose()

    assert asyncio.run(violations()) == []
    assert call(addr["trainer"], "/slipstream.v1.TrainerService/Stop", b"") == grpc.StatusCode.OK
    assert procs["trainer"].wait(120) == 0, procs["trainer"].log[-3000:]
    for name, full_name, method in (rpc for rpc in rpcs() if rpc[1] in TRAINERS_OWN):
        fuzz(services, name, full_name, method)
    assert asyncio.run(violations()) == []


@pytest.mark.timeout(300)
def test_values_the_generic_fuzzer_seldom_reaches_are_invalid_argument_naming_the_field(services):
    """Found by fuzzing: each of these was an INTERNAL error, an endless loop holding the batch lock, or work sent to
    the engines unchecked."""
    from google.protobuf.struct_pb2 import Struct

    addr = services[0]
    metadata = Struct()
    metadata.update({"rm_type": 3})
    nan = float("nan")
    cases = [
        ("reward", "/slipstream.v1.RewardService/Score",
         reward_pb2.ScoreRequest(items=[reward_pb2.RewardItem(response=b"1", label="1", metadata=metadata)]),
         "items[0].metadata.rm_type:"),
        ("reward", "/slipstream.v1.RewardService/Score", reward_pb2.ScoreRequest(timeout_seconds=nan),
         "timeout_seconds:"),
        ("buffer", "/slipstream.v1.BufferService/GetBatch",
         buffer_pb2.GetBatchRequest(step=0, timeout_seconds=nan), "timeout_seconds:"),
        ("rollout", "/slipstream.v1.RolloutService/Evaluate",
         rollout_pb2.EvaluateRequest(n_samples_per_prompt=2**31 - 1), "n_samples_per_prompt:"),
    ]  # fmt: skip
    temperature = rollout_pb2.EvaluateRequest()
    temperature.sampling_params.temperature = nan
    cases.append(("rollout", "/slipstream.v1.RolloutService/Evaluate", temperature, "sampling_params.temperature:"))
    for name, method, request, field in cases:
        with grpc.insecure_channel(addr[name]) as channel:
            rpc = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as refused:
                rpc(request.SerializeToString(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, refused.value.details())
        assert refused.value.details().startswith(field), (method, refused.value.details())


@pytest.mark.timeout(300)
def test_a_100_mb_score_request_is_refused_unparsed_with_resource_exhausted(services):
    request = reward_pb2.ScoreRequest(items=[reward_pb2.RewardItem(response=b"x" * (100 * 2**20), label="1")])
    with grpc.insecure_channel(services[0]["reward"]) as channel:
        rpc = channel.unary_unary("/slipstream.v1.RewardService/Score", request_serializer=None,
                                  response_deserializer=None)  # fmt: skip
        with pytest.raises(grpc.RpcError) as refused:
            rpc(request.SerializeToString(), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Score: the request is 104,857,6" in refused.value.details() and "64 MiB" in refused.value.details()
    still_serving(services, "reward")
