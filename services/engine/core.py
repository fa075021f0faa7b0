"""The engine thread: admits waiting sequences, runs decode steps, applies stop rules, and runs control commands
(pause, abort, weight loads) between steps, so a weight update never lands in the middle of a forward pass.
"""

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from services.engine.batch import Batcher, Sequence
from services.engine.routing import RoutingCapture
from services.engine.sampling import choose_batch

log = logging.getLogger(__name__)

Listener = Callable[[Sequence, bool], None]  # called after each new token; the flag says the sequence finished


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
    ):
        self.model, self.tokenizer, self.device, self.routing = model, tokenizer, device, routing
        self.adapters = adapters  # LoRA adapters (services/engine/lora.py) under --enable-lora
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.max_context = int(getattr(model.config, "max_position_embeddings", 32768))
        self.eos_ids = _eos_ids(model, tokenizer)
        self.batcher = Batcher(model, device, routing, adapters, graphs, max_batch_size, cache)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.listeners: dict[int, Listener] = {}
        self.paused: str | None = None
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # decode steps by batch size
        self._commands: collections.deque[tuple[Callable, Future]] = collections.deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # Called from other threads

    def submit(self, seq: Sequence, listener: Listener) -> None:
        with self._wake:
            self.listeners[id(seq)] = listener
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
                while not self._stopped and not self._commands and (self.paused or not self._has_work()):
                    self._wake.wait()
                if self._stopped:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for function, future in commands:
                try:
                    future.set_result(function())
                except Exception as e:  # the caller gets the error; the engine keeps serving
                    future.set_exception(e)
            if commands:  # a command may have changed the weights: cached prefixes would be stale
                self.batcher.forget_prefixes()
            if self.paused or not self._has_work():
                continue
            try:
                self._admit()
                if self.batcher.rows:
                    self._step()
            except Exception as e:  # a failing step aborts what was running, not the server
                log.exception("engine step failed")
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

    def _step(self) -> None:
        result = self.batcher.step()
        if result.retracted:
            self._requeue(result.retracted)
        if result.ready:
            self.batch_sizes[len(result.ready)] += 1
            self._advance(result.ready, result.logits)

    def _advance(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        """Picks each sequence's next token from its logits row [rows, vocab], applies the stop rules, and lets
        finished sequences leave the batch."""
        for row, seq in enumerate(sequences):
            if len(seq.output_ids) < seq.params.min_new_tokens and not seq.params.ignore_eos:
                logits[row, list(self.eos_ids)] = float("-inf")
        picked = choose_batch(logits, [s.params for s in sequences], [s.generator for s in sequences])
        done = []
        for seq, (token, logprob) in zip(sequences, picked, strict=True):
            self._append(seq, token, logprob)
            if seq.finish:
                done.append(seq)
        self.batcher.drop(done)

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        params = seq.params
        if params.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
            return
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.versions.append(self.weight_version)
        finish = self._stop_reason(seq, token)
        if finish is not None:
            self._finish(seq, finish)
        else:
            self._notify(seq, False)

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
        listener = self.listeners.get(id(seq))
        if finished:
            self.listeners.pop(id(seq), None)
        if listener is not None:
            listener(seq, finished)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in [*ids, tokenizer.eos_token_id] if i is not None}
