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
    ):
        self.model, self.tokenizer, self.device, self.routing = model, tokenizer, device, routing
        self.adapters = adapters  # LoRA adapters (services/engine/lora.py) under --enable-lora
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.max_context = int(getattr(model.config, "max_position_embeddings", 32768))
        self.eos_ids = _eos_ids(model, tokenizer)
        self.batcher = Batcher(model, device, routing, adapters, graphs)
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
        with self._wake:
            for seq in reversed(rows):
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
            if self.paused or not self._has_work():
                continue
            try:
                self._admit()
                if self.batcher.rows:
                    self._decode()
            except Exception as e:  # a failing step aborts what was running, not the server
                log.exception("engine step failed")
                self.abort(self.running(), f"engine error: {type(e).__name__}: {e}")

    def _has_work(self) -> bool:
        return bool(self.waiting or self.batcher.rows)

    def _admit(self) -> None:
        """Waiting sequences join the batch, prefilled together in one forward pass."""
        with self._wake:
            room = self.max_batch_size - len(self.batcher.rows)
            joining = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        if not joining:
            return
        prompt_logits = self.batcher.prefill(joining)
        for seq, logits in zip(joining, prompt_logits, strict=True):
            if seq.return_logprob and not seq.output_ids:
                seq.input_logprobs = _input_logprobs(logits, seq.prompt_ids, seq.logprob_start_len)
        self._advance(joining, torch.stack([logits[-1] for logits in prompt_logits]))

    def _decode(self) -> None:
        self.batch_sizes[len(self.batcher.rows)] += 1
        self._advance(list(self.batcher.rows), self.batcher.step())

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


def _input_logprobs(logits: torch.Tensor, prompt: list[int], start: int) -> list[float | None]:
    """Log-probs of the prompt tokens from position `start` on (-1: only the last one), as SGLang lists them: the
    first entry has none, entry j is log p(token_j | tokens before j)."""
    start = len(prompt) - 1 if start < 0 else min(start, len(prompt) - 1)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [None, *(float(logprobs[j - 1, prompt[j]]) for j in range(start + 1, len(prompt)))]


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in [*ids, tokenizer.eos_token_id] if i is not None}
