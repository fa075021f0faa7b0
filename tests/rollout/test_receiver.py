"""The streamed weight path on the CPU, for real: a trainer's end of a gloo weight group (this test), a `slipstream
receiver` process that joins it for its engine, and a `slipstream engine` process that loads each bucket through
SGLang's /update_weights_from_ipc route (checkpoint-engine's worker protocol over ZMQ, the buffer in shared memory).
One call carries the sync's whole plan; the buckets follow with no call between them."""

import socket
import threading

import httpx
import pytest
import torch
from safetensors.torch import load_file

from services.receiver.stream import Bucket, Buffers, Copies, EngineRoute, Sync
from services.weightsync.group import bucket_layout, flatten_aligned, init_custom_process_group
from tests.rollout.conftest import wait_healthy, weights_of


def _start_receiver(service_process, free_port, engine_url: str) -> str:
    port = free_port()
    proc = service_process("receiver", "--engine-url", engine_url, "--port", str(port), "--timeout-s", "60")
    return wait_healthy(proc, f"http://127.0.0.1:{port}")


def _plan(tensors: dict[str, torch.Tensor], per_bucket: int) -> list[list[str]]:
    names = sorted(tensors)
    return [names[i : i + per_bucket] for i in range(0, len(names), per_bucket)]


def _stream(receiver: str, tensors: dict, plan: list[list[str]], version: str, group=None, name: str = "g"):
    """Sends one sync: joins the group first when `group` is None (returns it), then the plan in one call while the
    buckets are broadcast. Returns (group, the receiver's answer)."""
    if group is None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        body = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "rank_offset": 1,
                "group_name": name, "backend": "gloo"}  # fmt: skip
        joined = threading.Thread(target=lambda: httpx.post(f"{receiver}/init_weights_update_group", json=body,
                                                            timeout=60).raise_for_status())  # fmt: skip
        joined.start()
        group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, name, listen_fd=listener.detach())
        joined.join()
    buckets = [{"names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(tensors[n].shape) for n in names]} for names in plan]  # fmt: skip
    answer = {}

    def call() -> None:
        body = {"group_name": name, "buckets": buckets, "weight_version": version}
        answer["reply"] = httpx.post(f"{receiver}/receive_weights", json=body, timeout=120)

    calling = threading.Thread(target=call)
    calling.start()
    for names in plan:
        dtypes, shapes = [tensors[n].dtype for n in names], [list(tensors[n].shape) for n in names]
        flat = flatten_aligned(
            (tensors[n] for n in names),
            dtypes,
            shapes,
            torch.zeros(bucket_layout(dtypes, shapes)[1], dtype=torch.uint8),
        )
        torch.distributed.broadcast(flat, src=0, group=group)
    calling.join()
    return group, answer["reply"]


def test_a_streamed_sync_reaches_the_engine_through_its_ipc_route(start_engine, service_process, free_port,
                                                                   tiny_model):  # fmt: skip
    """Two syncs over one group, in buckets of three tensors (double-buffered): the engine ends with exactly the
    sent tensors, every one by its checkpoint name, under the sync's version. The engine's route takes only an
    address for its own device, and only a local one."""
    engine = start_engine()
    receiver = _start_receiver(service_process, free_port, engine)
    hf = load_file(tiny_model / "model.safetensors")
    group = None
    for version in (1, 2):
        sent = {name: (t + 0.01 * version).contiguous() for name, t in hf.items()}
        group, reply = _stream(receiver, sent, _plan(sent, 3), str(version), group)
        assert reply.status_code == 200, reply.text
        assert httpx.get(f"{engine}/model_info", timeout=10).json()["weight_version"] == str(version)
        for name, tensor in sent.items():
            assert torch.equal(weights_of(engine, name), tensor), name
    torch.distributed.destroy_process_group(group)
    for handles, reason in (({"GPU-0": "ipc://@x"}, "no address for this engine's device 'cpu'"),
                            ({"cpu": "tcp://10.0.0.1:5555"}, "must be a local ipc:// address")):  # fmt: skip
        reply = httpx.post(f"{engine}/update_weights_from_ipc", json={"zmq_handles": handles}, timeout=30)
        assert reply.status_code == 400 and reason in reply.json()["message"], reply.text


def test_a_bucket_the_engine_cannot_load_fails_the_sync_naming_it_and_the_next_sync_works(start_engine,
                                                                                          service_process, free_port,
                                                                                          tiny_model):  # fmt: skip
    """A tensor the model lacks: the receiver answers 400 with the engine's reason, leaves the group (the trainer
    builds a new one), and the engine is free for the next sync at once."""
    engine = start_engine()
    receiver = _start_receiver(service_process, free_port, engine)
    hf = load_file(tiny_model / "model.safetensors")
    wrong = {**hf, "model.layers.9.mlp.up_proj.weight": torch.zeros(4, 4)}
    group, reply = _stream(receiver, wrong, _plan(wrong, 4), "1")
    assert reply.status_code == 400
    assert "no parameter named 'model.layers.9.mlp.up_proj.weight'" in reply.json()["message"]
    torch.distributed.destroy_process_group(group)
    sent = {name: (t + 0.5).contiguous() for name, t in hf.items()}
    group, reply = _stream(receiver, sent, _plan(sent, 4), "2", name="g2")
    assert reply.status_code == 200, reply.text
    for name, tensor in sent.items():
        assert torch.equal(weights_of(engine, name), tensor), name
    torch.distributed.destroy_process_group(group)


@pytest.fixture
def buffers_by_file_name():
    """As in the receiver's process (services/receiver/server.py), CPU buffers reach the engine by file name; torch's
    default, a descriptor passed through this process's resource sharer, is refused by an engine that this process
    did not start (it fails the sharer's handshake). A test of this process that colocates may have set it already."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(before)


@pytest.mark.parametrize("mode", ["whole", "delta"])
def test_a_sync_that_ends_before_the_engine_connected_ends_the_engines_update_too(
    start_engine, tiny_model, buffers_by_file_name, mode
):
    """The group is destroyed (the gateway gave up) before the engine took the sync's first message, or while its
    answer is due: the engine is told, and its update ends now rather than at its own deadline (minutes), in which
    it would keep every later sync out (found by a delta sync under load, whose retries each timed out). Nothing is
    posted on the destroyed group, whether the engine answered its buffer's handle at once or not."""
    engine = start_engine()
    hf = load_file(tiny_model / "model.safetensors")
    buckets = [Bucket([name], [tensor.dtype], [list(tensor.shape)]) for name, tensor in sorted(hf.items())]
    cancelled = threading.Event()
    cancelled.set()
    delta = {"version": 1, "base_version": 0} if mode == "delta" else None
    buffers = Copies([torch.device("cpu")]) if delta else Buffers([torch.device("cpu")], budget=1 << 20)
    route = EngineRoute(engine, "/update_weights_from_ipc", {})
    sync = Sync(None, cancelled, buckets, buffers, route, None, False, 120.0, delta=delta)
    with pytest.raises(RuntimeError, match="destroyed while streaming"):
        sync.run()
    assert "the sender ended the update: the weight update group was destroyed" in sync.call.result()["message"]


def test_the_receivers_room_holds_as_many_buckets_as_its_budget_at_least_three_at_most_the_plans():
    def plan(count: int, size_kib: int) -> list[Bucket]:
        return [Bucket([f"w{i}"], [torch.uint8], [[size_kib << 10]]) for i in range(count)]

    buffers = Buffers([torch.device("cpu")], budget=2048 << 10)  # as 2,048 MiB with MiB buckets, a thousandth
    buffers.fit(plan(16, 512))
    assert (buffers.slots, buffers.slot) == (4, 512 << 10)  # the budget's four
    buffers.fit(plan(73, 128))
    assert (buffers.slots, buffers.slot) == (4, 512 << 10)  # the room it has holds them
    buffers.fit(plan(3, 2048))
    assert (buffers.slots, buffers.slot) == (3, 2048 << 10)  # at least three, over the budget
    small = Buffers([torch.device("cpu")], budget=2048 << 10)
    small.fit(plan(18, 1))
    assert small.slots == 18 and small.tensors[0].numel() == 18 << 10  # no more than the plan's buckets
    assert small.start(19) == 1 << 10
