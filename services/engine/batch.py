"""The scheduler's batch: the running sequences, their places in the paged KV cache, and one forward a step.

Each step feeds every decoding sequence its one new token and, in the same forward, as much of the waiting prompts
as the step's token budget (`chunked_prefill_size`) leaves: a long prompt is prefilled over several steps while the
others keep decoding. The forward is one flat batch [1, tokens] through the model, its attention reading the paged
cache (services/engine/attention.py); a step that only decodes replays a CUDA graph of its batch size's bucket
(services/engine/graphs.py). Blocks come from services/engine/blocks.py: a sequence admitted behind another with the
same prompt waits until that prompt's blocks are computed, then shares them and prefills only its own tail.
"""

import contextlib
import time
from dataclasses import dataclass, field

import torch

from services.common.device_memory import free_and_total
from services.engine import attention, paged_prefill, sampling
from services.engine.blocks import Blocks, Chain
from services.engine.graphs import DecodeGraphs, bucket
from services.engine.routing import RoutingCapture
from services.engine.sampling import SamplingParams, pick_temperature
from services.engine.transfer import to_device

INITIAL_BLOCKS = 64


@dataclass(eq=False)  # a sequence is itself: two samples of one prompt are two sequences
class Sequence:
    """One sample being generated (a request with n > 1 has n of them)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the weight version that produced each output token
    finish: dict | None = None
    text: str = ""
    num_retractions: int = 0
    cached: int = 0  # positions whose keys and values are in the cache
    cached_tokens: int = 0  # prompt positions taken from the prefix cache (SGLang's meta_info cached_tokens)
    return_routed_experts: bool = False  # asked for, and the server captures routing
    routed_experts_start_len: int = 0
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [tokens, layers, top_k] of each forward
    lora: str | None = None  # the LoRA adapter it is generated with (lora_path), None for the base model
    chain: Chain = field(default_factory=Chain)
    row: int = 0  # its row of the block tables while running
    pending: int = 0  # tokens sampled on the device that the engine thread has not read yet (services/engine/core.py)
    plain: bool = True  # its tokens are drawn by the step itself (sampling.plain), set when it joins

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.output_ids[max(start - prompt, 0) : max(end - prompt, 0)]

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and not self.output_ids

    @property
    def exact(self) -> bool:
        """Computes every position itself: what it returns per prompt position needs them all."""
        return self.wants_input_logprobs or self.return_routed_experts


@dataclass
class CacheConfig:
    page_size: int = 16
    chunked_prefill_size: int = 8192
    max_total_tokens: int | None = None  # None: as many as `mem_fraction_static` allows
    mem_fraction_static: float = 0.85


@dataclass
class Result:
    """A step's outcome: the sequences whose next token is due, with their logits rows [ready, vocab], and those
    retracted for want of cache (back to the queue, without their cache). Where every running sequence is plain,
    `picked` [ready, 2] holds their next tokens and log-probs (float64, on the device), drawn by the step."""

    ready: list[Sequence]
    logits: torch.Tensor | None
    retracted: list[Sequence]
    rows: torch.Tensor | None = None  # the ready sequences' table rows, on the device
    picked: torch.Tensor | None = None


class Batcher:
    def __init__(self, model: torch.nn.Module, device: torch.device, routing: RoutingCapture | None = None,
                 adapters=None, graphs: DecodeGraphs | None = None, max_rows: int = 64,
                 cache: CacheConfig | None = None, pick=None):  # fmt: skip
        self.model, self.device, self.routing, self.adapters, self.graphs = model, device, routing, adapters, graphs
        self.config = cache or CacheConfig()
        self.block_size = self.config.page_size
        self.rows: list[Sequence] = []
        max_context = int(getattr(model.config, "max_position_embeddings", 32768))
        self.tables = torch.zeros(max_rows + 1, -(-max_context // self.block_size) + 1, dtype=torch.int32,
                                  device=device)  # fmt: skip  # row 0: padded rows' (block 0 only)
        self.free_rows = list(range(max_rows, 0, -1))
        self.table_updates: list[tuple[int, int, int]] = []  # (row, column, block) not yet in `tables`
        self.last_tokens = torch.zeros(max_rows + 1, dtype=torch.long, device=device)  # each row's next input
        self.token_updates: list[tuple[int, int]] = []  # (row, token) not yet in `last_tokens`
        self.temperatures = torch.ones(max_rows + 1, device=device)  # each plain row's (sampling.pick), 0 greedy
        self.temperature_updates: list[tuple[int, float]] = []  # (row, temperature) not yet in `temperatures`
        self.pick = pick or sampling.pick  # compiled under --enable-torch-compile (services/engine/compiled.py)
        self.unplain = 0  # running sequences that are not plain: while there are any, the engine draws every token
        self.static = torch.zeros(2, bucket(max_rows), dtype=torch.long, device=device)  # a graph's inputs
        self.feeds = [torch.zeros_like(self.static, device="cpu", pin_memory=device.type == "cuda") for _ in range(2)]
        self.decode_kernel = _decode_kernel(device)
        self.prefill_kernel = paged_prefill.PagedPrefill.make(device)
        self.eager_steps, self.eager_seconds = 0, 0.0  # steps run without a graph and the thread's time in them
        self._reset_cache()

    def _reset_cache(self) -> None:
        initial = min(INITIAL_BLOCKS, self._max_blocks()) if self.config.max_total_tokens else INITIAL_BLOCKS
        self.blocks = Blocks(self.block_size, initial)
        self.pool = attention.KvPool(initial * self.block_size)

    # Admission

    def admit(self, seq: Sequence) -> str:
        """Takes `seq` in: "joined", "wait" (the blocks of its prompt are being computed by another sequence: it
        joins once they are) or "full" (no room in the cache now)."""
        if not self.free_rows:
            return "full"
        tokens = seq.tokens(0, seq.length)
        shared, hashes, computing = ([], [], False) if seq.exact else self.blocks.match(tokens)
        if computing:
            return "wait"
        if not self._room(self.blocks.needed(seq.length + 1, Chain(blocks=shared)) + len(shared)):
            return "full"
        seq.row = self.free_rows.pop()
        seq.plain = sampling.plain(seq.params, seq.generator)
        self.unplain += not seq.plain
        self.temperature_updates.append((seq.row, pick_temperature(seq.params)))
        self.blocks.share(seq.chain, shared, hashes)
        self._write_table(seq, 0)
        seq.cached = len(shared) * self.block_size
        if not seq.output_ids:
            seq.cached_tokens = seq.cached
        if seq.wants_input_logprobs:
            seq.input_logprobs = [None]
        self.blocks.plan(seq.chain, tokens, seq.length)
        self.rows.append(seq)
        return "joined"

    def _room(self, blocks: int) -> bool:
        """Whether `blocks` more blocks can be had, growing the cache if it must and may."""
        if blocks <= self.blocks.num_free:
            return True
        limit = self._max_blocks()
        if self.blocks.num_blocks + blocks - self.blocks.num_free > limit:
            return False
        grown = min(limit, max(2 * self.blocks.num_blocks, self.blocks.num_blocks + blocks))
        self.pool.resize(grown * self.block_size)
        self.blocks.grow(grown)
        if self.graphs is not None:
            self.graphs.clear()  # they hold the old cache's addresses
        return True

    def _max_blocks(self) -> int:
        if self.config.max_total_tokens is not None:
            return max(self.config.max_total_tokens // self.block_size, 2)
        per_block = self.pool.bytes_per_slot() * self.block_size
        if per_block == 0:  # no forward yet: shapes unknown
            return 2 * self.blocks.num_blocks
        have = self.pool.num_slots * self.pool.bytes_per_slot()
        return (have + _spare_bytes(self.device, self.config.mem_fraction_static)) // per_block

    def _write_table(self, seq: Sequence, first: int) -> None:
        """Queues the chain's blocks from `first` on for its table row; `_flush_table` writes them all at once."""
        for column, block in enumerate(seq.chain.blocks[first:], first):
            self.table_updates.append((seq.row, column, block))

    def _flush_table(self) -> None:
        """Writes the queued table entries and input tokens: one copy to the device a step, not one a sequence."""
        if self.table_updates:
            rows, columns, blocks = self._to_device(torch.tensor(self.table_updates, dtype=torch.int32).T)
            self.tables[rows.long(), columns.long()] = blocks
            self.table_updates = []
        if self.token_updates:
            rows, tokens = self._to_device(torch.tensor(self.token_updates).T)
            self.last_tokens[rows] = tokens
            self.token_updates = []
        if self.temperature_updates:
            rows, temperatures = self._to_device(torch.tensor(self.temperature_updates).T)
            self.temperatures[rows.long()] = temperatures
            self.temperature_updates = []

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return to_device(host, self.device)

    def sampled(self, result: Result, tokens: torch.Tensor) -> None:
        """The tokens the engine drew for the step's ready sequences [ready] on the device (a step without
        `picked`): the inputs of their next step, read there."""
        self.last_tokens[result.rows] = tokens

    def _reserve(self, seq: Sequence, positions: int) -> bool:
        need = self.blocks.needed(positions, seq.chain)
        if not need:
            return True
        if not self._room(need):
            return False
        first = len(seq.chain.blocks)
        self.blocks.extend(seq.chain, need)
        self._write_table(seq, first)
        return True

    # Leaving

    def drop(self, leaving: list[Sequence]) -> None:
        """Removes finished, aborted or retracted sequences: their blocks and table rows are free again."""
        if not leaving:
            return
        gone = {id(seq) for seq in leaving}
        for seq in self.rows:
            if id(seq) in gone:
                self.blocks.release(seq.chain)
                self.free_rows.append(seq.row)
                self.unplain -= not seq.plain
        self.rows = [seq for seq in self.rows if id(seq) not in gone]

    def release(self) -> None:
        """Frees the cache and the graphs (an idle engine releasing its GPU memory); both come back when needed."""
        if self.graphs is not None:
            self.graphs.clear()
        self._reset_cache()

    def forget_prefixes(self) -> None:
        self.blocks.forget()

    # A step

    @torch.no_grad()
    def step(self) -> Result:
        """Queues the step's forward on the device. A decoding sequence's input is its last token, which the step
        before may have sampled on the device (`last_tokens`): a step is queued before the last one's tokens are
        read. Sequences whose sampled tokens already reach their max_new_tokens sit the step out."""
        singles, prefills = [], []
        for seq in self.rows:  # one pass, inlined: it runs for every row every step
            made = len(seq.output_ids) + seq.pending  # its tokens once the pending ones are read
            if len(seq.prompt_ids) + made - 1 > seq.cached:
                prefills.append(seq)
            elif not seq.pending or made < seq.params.max_new_tokens:
                singles.append(seq)
        retracted = self._make_room(singles)
        if retracted:
            singles = [seq for seq in singles if seq not in retracted]
            prefills = [seq for seq in prefills if seq not in retracted]
        self.token_updates += [(seq.row, seq.tokens(seq.cached, seq.length)[0]) for seq in singles if not seq.pending]
        chunks, budget = [], self.config.chunked_prefill_size - len(singles)
        for seq in prefills:
            if budget <= 0:
                break
            count = min(seq.length - seq.cached, budget)
            if not self._reserve(seq, seq.cached + count):
                break
            chunks.append((seq, seq.cached, count))
            budget -= count
        if not singles and not chunks:
            if prefills:  # every one is a prefill the cache cannot take a chunk of: the latest goes back
                retracted.append(prefills[-1])
                self.drop([prefills[-1]])
            return Result([], None, retracted)
        if chunks or not self._graphable():
            started = time.perf_counter()
            ready, logits = self._eager(singles, chunks)
            self.eager_steps += 1
            self.eager_seconds += time.perf_counter() - started
            rows = self._to_device(torch.tensor([seq.row for seq in ready]))
            return Result(ready, logits, retracted, rows, None if self.unplain else self._pick(logits, rows))
        logits, picked = self._replay(singles)
        return Result(singles, logits, retracted, self.static[1, : len(singles)], None if self.unplain else picked)

    def _make_room(self, singles: list[Sequence]) -> list[Sequence]:
        """A block for each decoding sequence whose new position starts one; the latest admitted sequences are
        retracted while the cache cannot give them (SGLang's retraction)."""
        retracted: list[Sequence] = []
        size = self.block_size
        for seq in singles:
            if seq.cached < len(seq.chain.blocks) * size:  # its blocks hold the new position: the usual case
                continue
            while seq not in retracted and not self._reserve(seq, seq.cached + 1):
                victim = self.rows[-1]  # the retracted have left `rows` already
                retracted.append(victim)
                self.drop([victim])
        return retracted

    def _graphable(self) -> bool:
        return self.graphs is not None and self.adapters is None and self.routing is None

    def _replay(self, singles: list[Sequence]) -> torch.Tensor:
        count = len(singles)
        rows = bucket(count)
        feed = self._feed()[:, :rows]
        feed.zero_()  # padded rows: position 0 of table row 0, whose block 0 is the scratch block and last token 0
        feed[:, :count] = torch.tensor([[seq.cached for seq in singles], [seq.row for seq in singles]])
        self.static[:, :rows].copy_(feed, non_blocking=True)
        self._flush_table()
        logits, picked = self.graphs.run(rows, lambda: self._decode_forward(rows))
        self._advance(singles, [], None)
        return logits[:count], picked[:count]

    def _feed(self) -> torch.Tensor:
        """A page-locked staging tensor for the graph's inputs, two in turn: the copy from one may still be queued
        behind the step before while the next step's inputs are written."""
        self.feeds.reverse()
        return self.feeds[0]

    def _decode_rows(self, positions: torch.Tensor, table_rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Decoding rows' tokens (each row's last), slots and lengths, from their positions and table rows, on the
        device (inside a CUDA graph for a replayed step)."""
        return self.last_tokens[table_rows], self._slots(positions, table_rows), positions + 1

    def _slots(self, positions: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
        """Each position's slot in the pool, through its sequence's row of the block tables, on the device."""
        size = self.block_size
        return self.tables[table_rows, positions // size].long() * size + positions % size

    def _decode_forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward over `rows` rows read from `static`, and its plain draw (what a CUDA graph captures):
        logits [rows, vocab] and picked [rows, 2]."""
        positions, table_rows = self.static[:, :rows]
        tokens, slots, lengths = self._decode_rows(positions, table_rows)
        width = self.tables.shape[1] * self.block_size  # a graph is replayed at every length: the table's width
        if self.device.type == "cpu":  # no graph: the longest row's
            width = -(-int(lengths.max()) // self.block_size) * self.block_size
        attention.current = self._layout(slots, rows, table_rows, lengths, [], width)
        logits = self.model(input_ids=tokens[None], position_ids=positions[None], use_cache=False).logits[0]
        return logits, self._pick(logits, table_rows)

    def _pick(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each row's next token and its log-prob [rows, 2] as plain sequences draw them (sampling.pick), on the
        device; the tokens become the rows' next inputs (a step whose batch is not all plain overwrites them)."""
        tokens, logprobs = self.pick(logits, self.temperatures[rows])
        self.last_tokens[rows] = tokens
        return torch.stack([tokens.double(), logprobs.double()], 1)

    def _layout(self, slots, num_decode, table_rows, lengths, chunks, width: int) -> attention.Step:
        return attention.Step(self.pool, self.block_size, self.tables, slots, num_decode, table_rows, lengths,
                              [seq.row for seq, _, _ in chunks], [s for _, s, _ in chunks], [n for _, _, n in chunks],
                              self.decode_kernel, width, self.prefill_kernel)  # fmt: skip

    def _eager(self, singles: list[Sequence], chunks: list[tuple[Sequence, int, int]]):
        """The forward of decoding rows and prompt chunks together: each token's input, position and table row
        gathered on the host as plain lists (a GRPO step's first prefill holds hundreds of chunks: no tensor op a
        chunk) and copied at once; its slot is worked out on the device, as a decoding row's."""
        num = len(singles)
        tokens, positions, rows = [0] * num, [seq.cached for seq in singles], [seq.row for seq in singles]
        keep = list(range(len(singles)))  # the flat positions whose logits are computed
        picks, ready = list(range(len(singles))), list(singles)  # the kept rows sampled from, for `ready`
        spans = []  # (sequence, first prompt position, its first kept row, count) for input log-probs
        offset = len(singles)
        for seq, start, count in chunks:
            tokens += seq.tokens(start, start + count)
            positions += range(start, start + count)
            rows += [seq.row] * count
            end = start + count
            first = max(start, _logprob_start(seq)) if seq.wants_input_logprobs else end
            if first < end:
                spans.append((seq, first, len(keep), end - first))
                keep.extend(range(offset + first - start, offset + count))
            elif end == seq.length:
                keep.append(offset + count - 1)
            if end == seq.length:
                picks.append(len(keep) - 1)
                ready.append(seq)
            offset += count
        self._flush_table()
        tokens, positions, rows = self._to_device(torch.tensor([tokens, positions, rows], dtype=torch.long))
        decode_tokens, _, lengths = self._decode_rows(positions[:num], rows[:num])
        flat = torch.cat([decode_tokens, tokens[num:]])
        longest = max([seq.cached + 1 for seq in singles] + [s + n for _, s, n in chunks])
        layout = self._layout(self._slots(positions, rows), num, rows[:num], lengths, chunks,
                              -(-longest // self.block_size) * self.block_size)  # fmt: skip
        attention.current = layout
        self._adapt(singles, chunks, keep)
        sequences = singles + [seq for seq, _, _ in chunks]
        with self._routing(sequences, (1, flat.shape[0])) as routed:
            out = self.model(input_ids=flat[None], position_ids=positions[None], use_cache=False,
                             logits_to_keep=self._to_device(torch.tensor(keep)))  # fmt: skip
        logits = out.logits[0]
        self._advance(singles, chunks, routed)
        for seq, first, at, count in spans:
            self._input_logprobs(seq, logits[at : at + count], first)
        return ready, logits[self._to_device(torch.tensor(picks))]

    def _advance(self, singles, chunks, routed) -> None:
        """After a forward: positions counted as cached, full blocks registered, routing kept."""
        size = self.block_size
        for seq in singles:  # each row: kept lean
            seq.cached += 1
            if seq.cached // size > len(seq.chain.hashes):  # a block filled: rare, the rest skipped for most rows
                self._register(seq)
        for seq, start, count in chunks:
            seq.cached = start + count
            self._register(seq)
        if routed:
            offset = 0
            for seq, count in [(seq, 1) for seq in singles] + [(seq, count) for seq, _, count in chunks]:
                if seq.return_routed_experts:
                    seq.routed_experts.append(routed[0][0, offset : offset + count].clone())
                offset += count

    def _register(self, seq: Sequence) -> None:
        """Offers the sequence's full blocks to the prefix cache; a block whose last token is pending is offered a
        step later."""
        known = min(seq.cached, seq.length)
        if known // self.block_size > len(seq.chain.hashes) and not seq.exact:
            self.blocks.register(seq.chain, seq.tokens(0, known), known)

    def _input_logprobs(self, seq: Sequence, logits: torch.Tensor, first: int) -> None:
        """SGLang's input_token_logprobs for positions first…: entry j is log p(prompt_j | before j)."""
        prompt = seq.prompt_ids
        end = min(first + logits.shape[0], len(prompt) - 1)
        if end <= first:
            return
        targets = torch.tensor(prompt[first + 1 : end + 1], device=logits.device)
        logprobs = torch.log_softmax(logits[: end - first].float(), -1).gather(1, targets[:, None])[:, 0]
        seq.input_logprobs.extend(logprobs.tolist())

    def _adapt(self, singles: list[Sequence], chunks, keep: list[int]) -> None:
        """Which of the forward's tokens, and of the positions whose logits it keeps, each LoRA adapter applies to
        (services/engine/lora.py)."""
        if self.adapters is None:
            return
        names = [seq.lora for seq in singles] + [seq.lora for seq, _, n in chunks for _ in range(n)]

        def where(positions: list[int]) -> dict[str, torch.Tensor]:
            found: dict[str, list[int]] = {}
            for i, position in enumerate(positions):
                if names[position]:
                    found.setdefault(names[position], []).append(i)
            return {name: torch.tensor(index, device=self.device) for name, index in found.items()}

        self.adapters.select(where(range(len(names))), where(keep))

    def _routing(self, sequences: list[Sequence], shape: tuple):
        """Captures the forward's routing only when a sequence in it asked for it (SGLang's return_routed_experts)."""
        if self.routing is None:
            return contextlib.nullcontext([])
        return self.routing.forward(tuple(shape), any(seq.return_routed_experts for seq in sequences))


def _logprob_start(seq: Sequence) -> int:
    prompt = len(seq.prompt_ids)
    return prompt - 1 if seq.logprob_start_len < 0 else min(seq.logprob_start_len, prompt - 1)


def _spare_bytes(device: torch.device, fraction: float) -> int:
    """Memory the cache may still take: what is free beyond the (1 - fraction) share of the device kept for others
    (activations, CUDA graphs, a colocated trainer)."""
    free, total = free_and_total(device)
    return max(0, int(free - (1 - fraction) * total))


def _decode_kernel(device: torch.device):
    if device.type != "cuda":
        return None
    from services.engine import paged_decode

    return paged_decode.PagedDecode.make(device)
