"""Colocated: each bucket goes as tensor handles (CUDA IPC), one set per trainer GPU, and every rank waits for the
gateway's answer (the tensors must live until the engines copied them)."""

from services.trainer.transports import Transport


class Handles(Transport):
    def send(self, index: int, specs: list, tensors) -> None:
        self.sender._hand_over(self.version, index, specs, tensors, self.requests, self.responses)
