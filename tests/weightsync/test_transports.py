"""The gateway's weight-sync transports: which one a sync takes, and where a streamed sync's receivers are."""

from types import SimpleNamespace

import pytest

from services.common.errors import FailedPrecondition
from services.rollout.config import RolloutConfig
from services.weightsync.factory import gateway_half as choose
from services.weightsync.protocol import Bucket
from services.weightsync.streamed import receiver_url
from slipstream.v1 import rollout_pb2

UNSPECIFIED, HANDLES, DISK = (rollout_pb2.WEIGHT_TRANSPORT_UNSPECIFIED, rollout_pb2.WEIGHT_TRANSPORT_HANDLES,
                              rollout_pb2.WEIGHT_TRANSPORT_DISK)  # fmt: skip


def _engine(url: str, ordered: bool = True, tp: int = 2):
    return SimpleNamespace(url=url, ordered_buckets=ordered, tp_size=tp, gpus=(0,))


def _config(offset: int | None = None, disk: str | None = None) -> RolloutConfig:
    return RolloutConfig(weight_receiver_port_offset=offset, update_weight_disk_dir=disk)


def test_each_sync_takes_the_transport_the_trainer_asks_for_or_the_gateways_settings_say():
    engines = [_engine("http://a:30000"), _engine("http://b:30000", ordered=False)]
    assert choose(HANDLES, engines, _config(1)).name == "handles"  # colocated, whatever else is set
    assert choose(DISK, engines, _config(1, "/shared/w")).name == "disk"  # the trainer's setting
    assert choose(UNSPECIFIED, engines, _config(100)).kind == rollout_pb2.WEIGHT_TRANSPORT_STREAMED  # receivers
    broadcast = choose(UNSPECIFIED, engines, _config())
    assert broadcast.name == "broadcast" and not broadcast.ordered  # one engine takes one bucket at a time
    assert choose(UNSPECIFIED, engines[:1], _config()).ordered


def test_a_disk_sync_loads_the_versions_folder_as_the_engines_see_it_at_the_commit():
    with pytest.raises(FailedPrecondition, match="--update-weight-disk-dir"):
        choose(DISK, [], _config())
    disk = choose(DISK, [], _config(disk="/mnt/weights/"))
    engines = [_engine("http://a:30000"), _engine("http://b:30000")]
    assert not disk.uses_group and disk.requests(engines, Bucket(0, ["w"], ["bfloat16"], [[2]])) is None
    path, bodies = disk.loads(engines, 42)
    assert path == "/update_weights_from_disk" and set(bodies) == {"http://a:30000", "http://b:30000"}
    assert bodies["http://a:30000"]["model_path"] == "/mnt/weights/weight_v000042"
    assert bodies["http://a:30000"]["weight_version"] == "42"


def test_a_receiver_is_on_its_engines_host_at_the_offset_port():
    assert receiver_url("http://engine-0:30000", 1) == "http://engine-0:30001"
    assert receiver_url("https://10.0.0.7:443/", 100) == "https://10.0.0.7:543"
    assert receiver_url("http://[fd00::1]:30000", -1000) == "http://[fd00::1]:29000"
    assert receiver_url("http://engine", 30000) == "http://engine:30080"  # the scheme's port


def test_a_streamed_sync_delivers_each_senders_plan_once_it_is_complete():
    streamed = choose(UNSPECIFIED, [], _config(1))
    engines = [_engine("http://a:30000", tp=2)]
    assert streamed.member(engines[0]) == ("http://a:30001", 1)  # one rank per engine, whatever its TP size
    first = Bucket(0, ["w1"], ["bfloat16"], [[2, 2]], group_name="g0", num_buckets=2)
    other = Bucket(0, ["v"], ["float32"], [[3]], group_name="g1", num_buckets=1)
    assert streamed.requests(engines, first) is None  # the plan of g0 is not complete yet
    assert streamed.requests(engines, other)[1]["http://a:30000"]["buckets"] == [
        {"names": ["v"], "dtypes": ["float32"], "shapes": [[3]]}
    ]
    path, bodies = streamed.requests(engines, Bucket(1, ["w2"], ["bfloat16"], [[4]], group_name="g0", num_buckets=2))
    assert path == "/receive_weights"
    assert [b["names"] for b in bodies["http://a:30000"]["buckets"]] == [["w1"], ["w2"]]
    unplanned = Bucket(0, ["w1"], ["bfloat16"], [[2, 2]], group_name="g0")  # a sender's first sync: a plan of one
    assert len(streamed.requests(engines, unplanned)[1]["http://a:30000"]["buckets"]) == 1
    whole = ((["w1"], ["bfloat16"], [[2, 2]]), (["w2"], ["bfloat16"], [[4]]))  # the plan in one message
    plan = Bucket(0, [], [], [], group_name="g0", num_buckets=2, plan=whole)
    assert streamed.requests(engines, plan)[1]["http://a:30000"]["buckets"] == [
        {"names": ["w1"], "dtypes": ["bfloat16"], "shapes": [[2, 2]]},
        {"names": ["w2"], "dtypes": ["bfloat16"], "shapes": [[4]]},
    ]


def test_the_last_senders_whole_plan_carries_the_syncs_version():
    """The engines take the version with the last plan's load (SGLang sets it once that load succeeded), so the
    commit posts none; a sender's first sync, a plan of one a bucket, leaves the version to the commit."""
    engines = [_engine("http://a:30000")]
    whole = ((["w"], ["bfloat16"], [[2]]),)
    streamed = choose(UNSPECIFIED, [], _config(1))
    streamed.open(7, ["g0", "g1"])
    first = streamed.requests(engines, Bucket(0, [], [], [], group_name="g0", num_buckets=1, plan=whole))[1]
    assert "weight_version" not in first["http://a:30000"] and not streamed.labelled
    last = streamed.requests(engines, Bucket(0, [], [], [], group_name="g1", num_buckets=1, plan=whole))[1]
    assert last["http://a:30000"]["weight_version"] == "7" and streamed.labelled
    first_sync = choose(UNSPECIFIED, [], _config(1))
    first_sync.open(1, ["g0"])
    body = first_sync.requests(engines, Bucket(0, ["w"], ["bfloat16"], [[2]], group_name="g0"))[1]
    assert "weight_version" not in body["http://a:30000"] and not first_sync.labelled


def _run(transport: str = "auto", mode: str = "full", lora_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(update_weight_transport=transport, update_weight_mode=mode, lora_rank=lora_rank)


def test_the_runs_transport_is_checked_with_its_other_settings_once_for_both_sides():
    """The rules the trainer and the gateway apply as they load their settings: a transport by name, delta only where
    the transport takes it, LoRA only as adapters, colocated only by handle (the trainer's)."""
    from services.weightsync.factory import refusal

    for fine in (_run(), _run("nccl"), _run(mode="delta"), _run("streamed", "delta"), _run("lora", lora_rank=8),
                 _run(lora_rank=8), _run("disk")):  # fmt: skip
        assert refusal(fine) is None and refusal(fine, colocate=False) is None
    assert refusal(_run("handles"), colocate=True) is None and refusal(_run(), colocate=True) is None
    assert "not one of auto, broadcast, streamed, handles, disk, lora" in refusal(_run("rdma"))
    assert refusal(_run("disk", "delta")) == (
        "--update-weight-mode delta: disk sends whole weights; use --update-weight-transport auto or streamed"
    )
    assert "--update-weight-transport lora (or auto)" in refusal(_run("disk", lora_rank=8))
    assert "add --lora-rank" in refusal(_run("lora"))
    assert "drop --update-weight-transport broadcast" in refusal(_run("broadcast"), colocate=True)
    assert "add --colocate" in refusal(_run("handles"), colocate=False)


def test_each_side_refuses_the_same_contradiction_as_it_loads_its_config(tmp_path):
    from services.common.config import ConfigError, load_config
    from services.trainer.config import TrainerConfig

    bad = ["--update-weight-transport", "broadcast", "--update-weight-mode", "delta"]
    for model in (TrainerConfig, RolloutConfig):
        with pytest.raises(ConfigError, match="delta: broadcast sends whole weights"):
            load_config(model, [*bad, "--hf-checkpoint", str(tmp_path)], "slipstream")
