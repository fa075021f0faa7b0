import pytest
import torch

from services.weightsync import delta as weight_delta


@pytest.mark.parametrize(("share", "kind"), [(0.0, weight_delta.INDICES), (0.01, weight_delta.INDICES),
                                             (0.2, weight_delta.BITMASK), (1.0, weight_delta.FULL)])  # fmt: skip
def test_a_delta_turns_the_base_into_the_new_bucket_bit_for_bit_in_the_smallest_encoding(share, kind):
    torch.manual_seed(0)
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    new = base.clone()
    words = new.view(torch.int16)
    moved = torch.randperm(words.numel())[: int(share * words.numel())]
    words[moved] = ~words[moved]  # every bit flips: every moved word differs
    got, changed, payload = weight_delta.encode(new, base)
    assert (got, changed) == (kind, moved.numel())
    assert payload.numel() == weight_delta.payload_size(kind, changed, new.numel())
    copy = base.clone()
    weight_delta.apply(kind, changed, payload.clone(), copy)
    assert torch.equal(copy, new)
    sums = weight_delta.checksums(copy, [0, 1024], [1024, 3072])
    assert torch.equal(sums, weight_delta.checksums(new, [0, 1024], [1024, 3072]))
    assert not torch.equal(sums, weight_delta.checksums(base, [0, 1024], [1024, 3072])) or not changed
