"""The contracts: committed stubs match the .proto files, and the protos follow the house rules."""

import filecmp

from google.protobuf import descriptor_pool

from slipstream import protogen, samples
from slipstream.v1 import buffer_pb2, common_pb2, reward_pb2, rollout_pb2, trainer_pb2

MODULES = [common_pb2, buffer_pb2, rollout_pb2, reward_pb2, trainer_pb2]


def test_committed_stubs_match_the_protos(tmp_path):
    generated = protogen.generate(tmp_path)
    assert generated, "protoc wrote nothing"
    committed_dir = protogen.ROOT / "slipstream" / "v1"
    for path in generated:
        committed = committed_dir / path.name
        assert committed.exists(), f"{path.name} is not committed; run `make protos`"
        assert filecmp.cmp(path, committed, shallow=False), f"{path.name} differs from the .proto; run `make protos`"
    stale = {p.name for p in committed_dir.glob("*_pb2*")} - {p.name for p in generated}
    assert not stale, f"stubs without a .proto: {stale}; delete them"


def test_every_enum_starts_with_unspecified():
    for module in MODULES:
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            first = enum.values_by_number[0].name
            assert first.endswith("_UNSPECIFIED"), f"{enum.full_name} value 0 is {first}"


def test_services_are_drafted_whole():
    pool = descriptor_pool.Default()
    expected = {
        "BufferService": {
            "LeasePrompts", "ExtendLease", "ReleaseLease", "SubmitGroup",
            "GetBatch", "CommitBatch", "SetPolicyVersion", "Rewind", "GetState",
        },
        "RolloutService": {
            "RegisterEngine", "DeregisterEngine", "ListEngines", "StartRollout", "StopRollout", "Evaluate",
            "PrepareWeightSync", "SyncWeightBuckets", "CommitWeightSync", "AbortWeightSync", "ReleaseEngineMemory",
        },
        "RewardService": {"Score", "ScoreGroup", "ListRewardFunctions"},
        "TrainerService": {"GetStatus", "SaveCheckpoint", "Stop"},
    }  # fmt: skip
    for service, methods in expected.items():
        found = {m.name for m in pool.FindServiceByName(f"slipstream.v1.{service}").methods}
        assert found == methods


def test_sample_round_trips_as_bytes():
    sample = common_pb2.Sample(
        sample_id="g1/0",
        tokens=samples.encode_tokens([1, 2, 3, 4]),
        prompt_length=2,
        response_length=2,
        loss_mask=samples.encode_mask([1, 0]),
        rollout_logprobs=samples.encode_logprobs([-0.5, -1.25]),
        reward=1.0,
        reward_details={"acc": 1.0},
        status=common_pb2.SAMPLE_STATUS_TRUNCATED,
        weight_versions=[common_pb2.WeightVersionSpan(version="3", start=0, end=2)],
    )
    sample.metadata.update({"turns": 2, "tool": "python"})
    back = common_pb2.Sample.FromString(sample.SerializeToString())
    assert back == sample
    assert samples.decode_tokens(back.tokens).tolist() == [1, 2, 3, 4]
    assert samples.decode_logprobs(back.rollout_logprobs).tolist() == [-0.5, -1.25]
    assert samples.decode_mask(back.loss_mask).tolist() == [1, 0]
