"""The engine thread: admits waiting sequences, runs decode steps, applies stop rules, and runs control commands
(pause, abort, weight loads) between steps, so a weight update never lands in the middle of a forward pass.

The thread queues each step on the device before it reads the step before's tokens (SGLang's overlap scheduling):
while the GPU runs step n + 1, whose decoding sequences read their input tokens from step n's samples on the device
(services/engine/batch.py), the thread appends step n's tokens, applies the stop rules and answers the requests. A
sequence that stops at step n has run one step too many; that step's token is dropped. Commands wait for the queued
step to be read.

An idle engine that gets a request waits until requests stop arriving (1 ms without one, 10 ms at most) before its
first step, so that a burst read one by one over HTTP is one prefill step.
"""

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from services.engine.batch import Batcher, Sequence
from services.engine.routing import RoutingCapture
from services.engine.sampling import choose_batch

log = logging.getLogger(__name__)

ARRIVAL_QUIET_S, ARRIVAL_WAIT_S = 0.001, 0.01  # an idle engine's wait for the rest of a burst of requests
Listener = Callable[[Sequence, bool], None]  # called after each new token; the flag says the sequence finished


@dataclass
class Queued:
    """A queued step's sampled tokens and log-probs for `ready`, on their way to the host ([ready, 2])."""

    ready: list[Sequence]
    host: torch.Tensor
    done: torch.cuda.Event | None


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        device: torch.device,
        max_batch_size: int,
        weight_version: str,
        routing: RoutingCapture | None = None,
        adapters=None,
        graphs=None,
        cache=None,
        pick=None,
    ):
        if device.type == "cuda" and device.index is None:  # the engine thread sets its device by index
            device = torch.device("cuda", torch.cuda.current_device())
        self.model, self.tokenizer, self.device, self.routing = model, tokenizer, device, routing
        self.adapters = adapters  # LoRA adapters (services/engine/lora.py) under --enable-lora
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.max_context = int(getattr(model.config, "max_position_embeddings", 32768))
        self.eos_ids = _eos_ids(model, tokenizer)
        self.batcher = Batcher(model, device, routing, adapters, graphs, max_batch_size, cache, pick)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.listeners: dict[int, Listener] = {}
        self.every_token: set[int] = set()  # the sequences whose listener hears of each token (a streamed request)
        self.paused: str | None = None
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # decode steps by batch size
        self._commands: collections.deque[tuple[Callable, Future]] = collections.deque()
        self._queued: Queued | None = None
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # Called from other threads

    def submit(self, seq: Sequence, listener: Listener, every_token: bool = True) -> None:
        """Queues `seq`; `listener` hears of its end, and of each new token unless `every_token` is False."""
        with self._wake:
            self.listeners[id(seq)] = listener
            if every_token:
                self.every_token.add(id(seq))
            self.waiting.append(seq)
            self._wake.notify()

    def call(self, function: Callable) -> Future:
        """Runs `function()` on the engine thread between steps (even while paused); its result in a Future."""
        future: Future = Future()
        with self._wake:
            self._commands.append((function, future))
            self._wake.notify()
        return future

    def running(self) -> list[Sequence]:
        return list(self.batcher.rows) + list(self.waiting)

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(10)

    # On the engine thread

    def abort(self, sequences: list[Sequence], message: str) -> None:
        for seq in sequences:
            with self._wake:  # submit() appends from other threads
                if seq in self.waiting:
                    self.waiting.remove(seq)
            self._finish(seq, {"type": "abort", "message": message, "status_code": None, "err_type": None})
        self.batcher.drop(sequences)

    def retract(self) -> None:
        """Running sequences go back to the front of the queue without their KV; they are prefilled again later."""
        rows = list(self.batcher.rows)
        self.batcher.drop(rows)
        self._requeue(rows)

    def _requeue(self, sequences: list[Sequence]) -> None:
        with self._wake:
            for seq in reversed(sequences):
                seq.num_retractions += 1
                seq.routed_experts = []  # the prefill that readmits it routes every position again
                self.waiting.appendleft(seq)

    def _loop(self) -> None:
        if self.device.type == "cuda":  # the thread's current device: else GPU 0's, where another engine may run
            torch.cuda.set_device(self.device)
        while True:
            with self._wake:
                while (not self._stopped and not self._commands and self._queued is None
                       and (self.paused or not self._has_work())):  # fmt: skip
                    self._wake.wait()
                if self._stopped:
                    return
                if not self.batcher.rows and self.waiting and not self._commands and not self.paused:
                    self._gather_arrivals()
                commands = list(self._commands)
                self._commands.clear()
            if commands:
                self._guarded(self._read)  # what the queued step produced, before a command changes anything
                for function, future in commands:
                    try:
                        future.set_result(function())
                    except Exception as e:  # the caller gets the error; the engine keeps serving
                        future.set_exception(e)
                self.batcher.forget_prefixes()  # a command may have changed the weights: cached prefixes are stale
            if self.paused or not self._has_work():
                self._guarded(self._read)
                continue
            self._guarded(self._iterate)

    def _gather_arrivals(self) -> None:
        """An idle engine that gets a request waits, before its first step, until requests stop arriving (none for
        ARRIVAL_QUIET_S, at most ARRIVAL_WAIT_S): a burst of requests read one by one over HTTP (a rollout's) is
        then one prefill step, not several with the first ones decoding beside each. Called holding `_wake`."""
        deadline, count = time.monotonic() + ARRIVAL_WAIT_S, len(self.waiting)
        while time.monotonic() < deadline and not self._stopped and not self._commands:
            self._wake.wait(ARRIVAL_QUIET_S)
            if len(self.waiting) == count:
                return
            count = len(self.waiting)

    def _iterate(self) -> None:
        self._admit()
        queued = self._step() if self.batcher.rows else None
        self._read()
        self._queued = queued

    def _guarded(self, work: Callable[[], None]) -> None:
        """Runs `work`; if it fails, what was running is aborted, not the server (nor the commands waiting)."""
        try:
            work()
        except Exception as e:
            log.exception("engine step failed")
            self._queued = None
            self.abort(self.running(), f"engine error: {type(e).__name__}: {e}")

    def _has_work(self) -> bool:
        return bool(self.waiting or self.batcher.rows)

    def _admit(self) -> None:
        """Waiting sequences join the batch in order while there is room; one whose prompt's blocks another is
        computing waits for them (services/engine/blocks.py) and those behind it go first."""
        with self._wake:
            waiting = list(self.waiting)
        joined = set()
        for seq in waiting:
            if seq.finish is not None:  # its last token was read after it was retracted: it leaves the queue
                joined.add(id(seq))
                continue
            if len(self.batcher.rows) >= self.max_batch_size:
                break
            state = self.batcher.admit(seq)
            if state == "joined":
                joined.add(id(seq))
            elif state == "full":
                if not self.batcher.rows:  # an empty cache cannot hold it: it never will
                    self.abort([seq], f"the prompt ({seq.length} tokens) does not fit in the KV cache")
                break
        if joined:
            with self._wake:
                self.waiting = collections.deque(seq for seq in self.waiting if id(seq) not in joined)

    def _step(self) -> Queued | None:
        """Queues a step and the choice of its next tokens on the device; their copy to the host is queued too."""
        result = self.batcher.step()
        if result.retracted:
            self._requeue(result.retracted)
        if not result.ready:
            return None
        self.batch_sizes[len(result.ready)] += 1
        picked = result.picked  # drawn by the step itself (every running sequence is plain)
        if picked is None:
            tokens, logprobs = self._choose(result.ready, result.logits)
            self.batcher.sampled(result, tokens)
            picked = torch.stack([tokens.double(), logprobs.double()], 1)
        for seq in result.ready:
            seq.pending += 1
        host = picked.to("cpu", non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Queued(result.ready, host, done)

    def _choose(self, sequences: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's next token and its log-prob from its logits row [rows, vocab], on the device."""
        for row, seq in enumerate(sequences):
            if len(seq.output_ids) + seq.pending < seq.params.min_new_tokens and not seq.params.ignore_eos:
                logits[row, list(self.eos_ids)] = float("-inf")
        return choose_batch(logits, [s.params for s in sequences], [s.generator for s in sequences])

    def _read(self) -> None:
        """Reads the queued step's tokens: appends them, applies the stop rules, and lets finished sequences leave
        the batch (a sequence that finished a step earlier drops its token)."""
        queued, self._queued = self._queued, None
        if queued is None:
            return
        if queued.done is not None:
            queued.done.synchronize()
        finished, version, every_token = [], self.weight_version, self.every_token
        for seq, (token, logprob) in zip(queued.ready, queued.host.tolist(), strict=True):  # each row: kept lean
            seq.pending -= 1
            if seq.finish is not None:
                continue
            if seq.params.max_new_tokens == 0:
                finish = {"type": "length", "length": 0}
            else:
                token = int(token)
                seq.output_ids.append(token)
                seq.output_logprobs.append(logprob)
                seq.versions.append(version)
                finish = self._stop_reason(seq, token)
            if finish is not None:
                self._finish(seq, finish)
                finished.append(seq)
            elif id(seq) in every_token:
                self._notify(seq, False)
        self.batcher.drop(finished)

    def _stop_reason(self, seq: Sequence, token: int) -> dict | None:
        params, count = seq.params, len(seq.output_ids)
        if count >= params.min_new_tokens:
            if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
                return {"type": "stop", "matched": token}
            if params.stop:
                text = self.decode(seq)
                for stop in params.stop:
                    if stop and stop in text[-(len(stop) + 64) :]:
                        return {"type": "stop", "matched": stop}
        if count >= params.max_new_tokens or seq.cached + 1 >= self.max_context:
            return {"type": "length", "length": params.max_new_tokens}
        return None

    def decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _finish(self, seq: Sequence, finish: dict) -> None:
        seq.finish = finish
        text = self.decode(seq)
        matched = finish.get("matched")
        if isinstance(matched, str) and not seq.params.no_stop_trim:
            text = text[: text.rfind(matched)] if matched in text else text
        seq.text = text
        if self.adapters is not None:
            self.adapters.finished(seq.lora)
        self._notify(seq, True)

    def _notify(self, seq: Sequence, finished: bool) -> None:
        if not finished and id(seq) not in self.every_token:
            return
        listener = self.listeners.get(id(seq))
        if finished:
            self.listeners.pop(id(seq), None)
            self.every_token.discard(id(seq))
        if listener is not None:
            listener(seq, finished)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in [*ids, tokenizer.eos_token_id] if i is not None}
