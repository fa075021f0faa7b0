"""The engine's scheduler over the paged KV cache (services/engine/batch.py): sequences that join, are prefilled in
chunks beside decoding ones, share a prompt's blocks, and leave mid-batch each get, at every step, the logits the
model gives that sequence alone; on a GPU also when the step replays from CUDA graphs and attention runs in Triton,
and with the decoder compiled.
Through the whole engine: greedy output equals transformers' `generate` for 64 mixed-length prompts served at once,
and the returned log-probs equal a forward pass."""

import copy
import threading

import pytest
import torch

from services.engine import attention
from services.engine.batch import Batcher, CacheConfig, Sequence
from services.engine.blocks import Chain
from services.engine.compiled import compile_decoder, compile_pick
from services.engine.core import Engine
from services.engine.graphs import DecodeGraphs
from services.engine.sampling import SamplingParams, pick

MODES = [
    pytest.param("cpu", False, False, id="cpu"),
    pytest.param("cpu", True, False, id="cpu-row-buckets"),  # the graphs' shapes, run eagerly: no CUDA here
    pytest.param("cpu", False, True, id="cpu-compiled"),
    pytest.param("cuda", True, False, id="cuda-graphs", marks=pytest.mark.gpu),
    pytest.param("cuda", True, True, id="cuda-graphs-compiled", marks=pytest.mark.gpu),
]


def paged(model: torch.nn.Module, device: str, compiled: bool = False) -> torch.nn.Module:
    attention.register()
    model = copy.deepcopy(model).to(device)
    model.set_attn_implementation(attention.NAME)
    if compiled:
        compile_decoder(model)
    return model


@pytest.mark.parametrize(("device", "graphs", "compiled"), MODES)
def test_every_row_of_every_step_equals_its_sequence_alone(hf_model, device, graphs, compiled):
    reference = copy.deepcopy(hf_model[0]).to(device)
    graphs = DecodeGraphs(torch.device(device), max_rows=8) if graphs else None
    cache = CacheConfig(page_size=4, chunked_prefill_size=16)  # prompts of 20 and 12 take several steps
    model = paged(hf_model[0], device, compiled)
    batcher = Batcher(model, torch.device(device), graphs=graphs, max_rows=8, cache=cache)
    prompts = [list(range(30 * i, 30 * i + length)) for i, length in enumerate((3, 20, 7, 12, 5))]
    prompts.append(prompts[1])  # shares sequence 1's blocks
    sequences = [Sequence(rid=str(i), prompt_ids=p, params=SamplingParams()) for i, p in enumerate(prompts)]

    def step() -> list[Sequence]:
        result = batcher.step()
        assert not result.retracted
        for seq, row in zip(result.ready, result.logits, strict=True):
            with torch.no_grad():
                alone = reference(input_ids=torch.tensor([seq.tokens(0, seq.length)], device=device)).logits[0, -1]
            torch.testing.assert_close(row, alone, atol=2e-4, rtol=1e-4)
            seq.output_ids.append(int(row.argmax()))
        return result.ready

    for seq in sequences[:3]:
        assert batcher.admit(seq) == "joined"
    ready = step()
    assert sequences[0] in ready and sequences[1] not in ready  # 20 tokens: more than the step's budget
    assert batcher.admit(sequences[5]) == "wait"  # its first blocks are sequence 1's, not yet computed
    for number in range(24):
        if number == 2:  # two more join a running batch
            assert [batcher.admit(seq) for seq in sequences[3:5]] == ["joined", "joined"]
        if number == 3:
            assert batcher.admit(sequences[5]) == "joined"
            assert sequences[5].cached == 16  # four blocks shared, the last (its final prompt token's) its own
        if number == 6:  # a sequence in the middle leaves
            batcher.drop([sequences[1]])
        step()
    assert len(sequences[5].output_ids) >= 20
    if device == "cuda":
        assert graphs.captures >= 1 and not graphs.failed  # bucket 8 (bucket 4 runs once: eagerly)
    batcher.drop(list(batcher.rows))
    assert batcher.rows == [] and batcher.blocks.num_free == batcher.blocks.num_blocks - 1


def test_a_full_cache_retracts_the_latest_sequences(hf_model):
    cache = CacheConfig(page_size=4, max_total_tokens=32)  # 8 blocks, one of them the scratch block
    batcher = Batcher(paged(hf_model[0], "cpu"), torch.device("cpu"), max_rows=8, cache=cache)
    sequences = [Sequence(rid=str(i), prompt_ids=list(range(20 * i, 20 * i + 7)), params=SamplingParams())
                 for i in range(3)]  # fmt: skip
    assert [batcher.admit(seq) for seq in sequences] == ["joined", "joined", "joined"]  # 2 blocks each, 6 of 7
    retracted = []
    for _ in range(6):
        result = batcher.step()
        retracted += result.retracted
        for seq, row in zip(result.ready, result.logits, strict=True):
            seq.output_ids.append(int(row.argmax()))
    assert retracted == [sequences[2]] and sequences[2] not in batcher.rows


def test_prefills_the_cache_cannot_take_go_back_one_at_a_time(hf_model):
    cache = CacheConfig(page_size=4, max_total_tokens=32)
    batcher = Batcher(paged(hf_model[0], "cpu"), torch.device("cpu"), max_rows=8, cache=cache)
    first, second = (Sequence(rid=str(i), prompt_ids=list(range(30 * i, 30 * i + 20)), params=SamplingParams())
                     for i in range(2))  # fmt: skip
    assert [batcher.admit(first), batcher.admit(second)] == ["joined", "joined"]  # 6 blocks each of 7: admitted
    batcher.blocks.extend(Chain(), 5)  # another holder takes most of the cache: neither prompt fits now
    assert batcher.step().retracted == [second]
    assert batcher.step().retracted == [first] and batcher.rows == []


def run_engine(model, tokenizer, sequences: list[Sequence], cache: CacheConfig, device: str = "cpu") -> None:
    graphs = DecodeGraphs(torch.device(device), 64) if device == "cuda" else None
    model = paged(model, device, compiled=device == "cuda")
    draw = compile_pick(pick) if device == "cuda" else None  # the step's own draw, compiled as the server does
    engine = Engine(model, tokenizer, torch.device(device), 64, "v1", graphs=graphs, cache=cache, pick=draw)
    done, finished = threading.Event(), []

    def listener(seq: Sequence, last: bool) -> None:
        if last:
            finished.append(seq)
            if len(finished) == len(sequences):
                done.set()

    try:
        for seq in sequences:
            engine.submit(seq, listener)
        assert done.wait(300)
    finally:
        engine.stop()


CACHES = [
    pytest.param(CacheConfig(page_size=16, chunked_prefill_size=8192), False, id="whole-prompts"),
    pytest.param(CacheConfig(page_size=4, chunked_prefill_size=48), True, id="shared-prefixes-chunked"),
    pytest.param(CacheConfig(page_size=4, max_total_tokens=384), True, id="retracting"),  # a third of what they need
]


def mixed_prompts(shared: bool) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    heads = [torch.randint(5, 400, (int(n),), generator=generator).tolist() for n in (9, 17, 30)]
    prompts = []
    for i in range(64):
        tail = torch.randint(5, 400, (int(torch.randint(1, 60, (1,), generator=generator)),), generator=generator)
        prompts.append((heads[i % 3] if shared else []) + tail.tolist())
    if shared:  # GRPO groups: the same prompt several times
        prompts[32:] = [prompts[i // 8] for i in range(32)]
    return prompts


@pytest.mark.parametrize(("cache", "shared"), CACHES)
def test_greedy_output_equals_transformers_for_64_prompts_at_once(hf_model, cache, shared):
    model, tokenizer = hf_model
    prompts = mixed_prompts(shared)
    params = SamplingParams(max_new_tokens=16, temperature=0)
    sequences = [Sequence(rid=str(i), prompt_ids=p, params=params, return_logprob=i % 4 == 0)
                 for i, p in enumerate(prompts)]  # fmt: skip
    run_engine(model, tokenizer, sequences, cache)
    for seq in sequences:
        with torch.no_grad():
            expected = model.generate(torch.tensor([seq.prompt_ids]), max_new_tokens=16, do_sample=False)
            expected = expected[0, len(seq.prompt_ids) :].tolist()
            assert seq.output_ids == expected[: len(seq.output_ids)] and len(seq.output_ids) >= len(expected)
            logits = model(torch.tensor([seq.tokens(0, seq.length)])).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)[len(seq.prompt_ids) - 1 : -1]
        chosen = logprobs.gather(1, torch.tensor(seq.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(seq.output_logprobs), chosen, atol=1e-4, rtol=0)
        if seq.return_logprob:  # the prompt's last position: every position from there on computed, none shared
            assert seq.cached_tokens == 0 and len(seq.input_logprobs) == 1
    if shared:
        assert sum(seq.cached_tokens > 0 for seq in sequences) >= 32
    if cache.max_total_tokens:  # sequences went back to the queue with a token still pending, and came back
        assert any(seq.num_retractions for seq in sequences)


BF16_DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", BF16_DEVICES)
@pytest.mark.parametrize(("cache", "shared"), CACHES)
def test_in_bf16_greedy_output_leaves_transformers_only_at_a_near_tie(hf_model, cache, shared, device):
    """In bf16 two correct implementations part at near-ties: on this model transformers' own bf16 `generate`
    equals its float32 one for only 39-47 of the 64 prompts, each time between float32's two best tokens. So each
    sequence equals transformers' bf16 tokens up to where they part, and there the two tokens score within 2 % of
    the largest logit in float32 (bf16's error in that gap reaches about 1.3 %; a wrong page, position or row parts
    where the gap is typically 8 %, and 97 % of these sequences have a position past 2 %); most agree whole."""
    reference = copy.deepcopy(hf_model[0]).to(device)  # float32
    model, tokenizer = copy.deepcopy(hf_model[0]).to(device, torch.bfloat16), hf_model[1]
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    sequences = [Sequence(rid=str(i), prompt_ids=p, params=params) for i, p in enumerate(mixed_prompts(shared))]
    run_engine(model, tokenizer, sequences, cache, device)
    whole = 0
    for seq in sequences:
        with torch.no_grad():
            expected = model.generate(torch.tensor([seq.prompt_ids], device=device), max_new_tokens=32,
                                      min_new_tokens=32, do_sample=False, eos_token_id=None)  # fmt: skip
        expected = expected[0, len(seq.prompt_ids) :].tolist()
        parted = next((k for k, (a, b) in enumerate(zip(seq.output_ids, expected, strict=True)) if a != b), None)
        if parted is None:
            whole += 1
            continue
        with torch.no_grad():
            logits = reference(torch.tensor([seq.prompt_ids + expected[:parted]], device=device)).logits[0, -1]
        gap = abs(logits[seq.output_ids[parted]] - logits[expected[parted]])
        assert gap <= 0.02 * logits.abs().max(), f"sequence {seq.rid} parts at token {parted}, not at a near-tie"
    assert whole >= len(sequences) // 2


def test_a_step_is_queued_before_the_last_ones_tokens_are_read_and_no_row_runs_past_its_length(hf_model):
    """The engine thread queues step n + 1 before it reads step n's tokens (core.py); a decoding sequence's input is
    then its last sample on the device. A sequence whose pending samples reach max_new_tokens sits the step out, so
    the steps' batch sizes are exactly those of the lengths asked for; the greedy tokens are still transformers'."""
    model, tokenizer = hf_model
    engine = Engine(paged(model, "cpu"), tokenizer, torch.device("cpu"), 8, "v1", cache=CacheConfig(page_size=4))
    prompts, lengths = [[5, 6, 7], [8, 9, 10, 11, 12]], (5, 9)
    sequences = [Sequence(rid=str(i), prompt_ids=p, params=SamplingParams(max_new_tokens=n, temperature=0,
                                                                          ignore_eos=True))
                 for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]  # fmt: skip
    read_when_queued = []  # the longer sequence's tokens read when each step was queued
    queue = engine._step
    engine._step = lambda: read_when_queued.append(len(sequences[1].output_ids)) or queue()
    done = threading.Event()
    engine.paused = "in_place"  # both join the first step
    try:
        for seq in sequences:
            engine.submit(seq, lambda seq, last: last and all(s.finish for s in sequences) and done.set())
        engine.call(lambda: setattr(engine, "paused", None))
        assert done.wait(60)
    finally:
        engine.stop()
    assert dict(engine.batch_sizes) == {2: 5, 1: 4}
    assert read_when_queued[:9] == [0, 0, 1, 2, 3, 4, 5, 6, 7]
    for seq, n in zip(sequences, lengths, strict=True):
        expected = model.generate(torch.tensor([seq.prompt_ids]), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, eos_token_id=None)[0, len(seq.prompt_ids):].tolist()  # fmt: skip
        assert seq.output_ids == expected and seq.pending == 0


def test_a_failing_step_aborts_what_runs_and_the_engine_keeps_serving(hf_model):
    """An error in a step (here a listener's, while the thread reads a queued step's tokens) aborts the running
    sequences with its message; commands still get their answers and new requests are served."""
    model, tokenizer = hf_model
    engine = Engine(paged(model, "cpu"), tokenizer, torch.device("cpu"), 8, "v1", cache=CacheConfig(page_size=4))
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    failing = Sequence(rid="0", prompt_ids=[5, 6, 7], params=params)
    ended = threading.Event()

    def listener(seq: Sequence, last: bool) -> None:
        if last:
            ended.set()
        elif len(seq.output_ids) == 3:
            raise RuntimeError("a listener's bug")

    try:
        engine.submit(failing, listener)
        assert ended.wait(60)
        assert failing.finish["type"] == "abort" and "a listener's bug" in failing.finish["message"]
        assert engine.call(lambda: 42).result(timeout=60) == 42
        served, done = Sequence(rid="1", prompt_ids=[5, 6, 7], params=params), threading.Event()
        engine.submit(served, lambda seq, last: last and done.set())
        assert done.wait(60) and served.finish["type"] == "length" and len(served.output_ids) == 40
    finally:
        engine.stop()
