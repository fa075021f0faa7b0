"""The engine's side of /update_weights_from_ipc (checkpoint-engine's worker protocol over ZMQ), driven from this
process as a weight receiver drives it: the sender's buffer stays mapped between updates, and a bucket sent as the same
bytes from that buffer again is loaded through the views made the first time, with the buffer's new contents."""

import itertools
import os
import pickle
import threading
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest
import torch
import zmq

from services.engine.ipc import IpcUpdates

ADDRESSES = (f"ipc://@slipstream-test-ipc-{os.getpid()}-{n}" for n in itertools.count())


class Weights:
    """Records what the engine would load: (names, tensors) a bucket, the tensors copied."""

    def __init__(self):
        self.engine = SimpleNamespace(device=torch.device("cpu"))
        self.loads: list[tuple[list[str], list[torch.Tensor]]] = []

    def check(self, names, shapes):
        return None if all(name.startswith("w") for name in names) else f"the model has no parameter named {names}"

    def copy_in(self, names, tensors, version=None, flat=False):
        self.loads.append((names, tensors))
        self.copied = [t.clone() for t in tensors]
        done = Future()
        done.set_result(None)
        return done


@pytest.fixture
def shared_by_file_name():
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(before)


def update(updates: IpcUpdates, buffer: torch.Tensor, messages: list[bytes]) -> list[bytes]:
    """One update: the buffer's handle, each message, then the two ends; the engine's answers."""
    socket, address = zmq.Context.instance().socket(zmq.REQ), next(ADDRESSES)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    served = threading.Thread(target=updates._serve, args=(address,))
    served.start()
    answers = []
    handle, end = pickle.dumps(bytes(ForkingPickler.dumps(buffer))), pickle.dumps(None)
    for message in [handle, *messages, end, end]:
        socket.send(message)
        assert socket.poll(30_000), "the engine did not answer"
        answers.append(socket.recv())
    served.join(30)
    socket.close()
    return answers[1:-2]


def test_a_bucket_sent_again_from_the_same_buffer_loads_through_its_views_with_the_new_contents(
    shared_by_file_name,
):
    weights = Weights()
    updates = IpcUpdates(weights, timeout_s=30)
    buffer = torch.zeros(64, dtype=torch.uint8).share_memory_()
    metadata = [{"name": "w1", "dtype": torch.float32, "shape": torch.Size([2, 2]), "offset": 0},
                {"name": "w2", "dtype": torch.bfloat16, "shape": torch.Size([4]), "offset": 32}]  # fmt: skip
    message = pickle.dumps(metadata)
    for value in (1.0, 2.0):
        buffer[:16].view(torch.float32).fill_(value)
        buffer[32:40].view(torch.bfloat16).fill_(-value)
        assert update(updates, buffer, [message]) == [b""]
        assert torch.equal(weights.copied[0], torch.full((4,), value))
        assert torch.equal(weights.copied[1], torch.full((4,), -value, dtype=torch.bfloat16))
    (names, first), (_, again) = weights.loads
    assert names == ["w1", "w2"] and all(a is b for a, b in zip(first, again, strict=True))  # the views of the first

    other = torch.zeros(64, dtype=torch.uint8).share_memory_()  # another buffer: its own views, nothing kept
    other[:16].view(torch.float32).fill_(3.0)
    assert update(updates, other, [message]) == [b""]
    assert not any(a is b for a, b in zip(first, weights.loads[-1][1], strict=True))
    assert torch.equal(weights.copied[0], torch.full((4,), 3.0))


def test_a_bucket_the_engine_cannot_load_is_not_kept(shared_by_file_name):
    weights = Weights()
    updates = IpcUpdates(weights, timeout_s=30)
    buffer = torch.zeros(64, dtype=torch.uint8).share_memory_()
    wrong = pickle.dumps([{"name": "x", "dtype": torch.float32, "shape": torch.Size([2]), "offset": 0}])
    for _ in range(2):
        assert b"no parameter named" in update(updates, buffer, [wrong])[0]
    assert not weights.loads and not updates.known
