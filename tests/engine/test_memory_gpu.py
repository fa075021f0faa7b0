"""The engine's weights released to page-locked host memory and resumed (services/engine/memory.py), on a GPU."""

import pytest
import torch

from services.engine.memory import HostCopy

pytestmark = pytest.mark.gpu


def test_release_frees_the_gpu_and_resume_brings_back_the_same_weights(hf_model):
    model = hf_model[0].to("cuda", torch.bfloat16)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    copy = HostCopy(model, torch.device("cuda"))
    for round_ in range(2):
        on_gpu = torch.cuda.memory_allocated()
        copy.release()
        assert all(t.device.type == "cpu" and t.is_pinned() for t in model.parameters())
        assert torch.cuda.memory_allocated() < on_gpu
        hosts = [h.data_ptr() for h in copy.host]
        copy.resume()
        assert all(t.device.type == "cuda" for t in [*model.parameters(), *model.buffers()])
        assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items()), round_
    copy.release()
    assert [h.data_ptr() for h in copy.host] == hosts  # the host copy is made once
