"""SGLang's response shapes: compact JSON (orjson-like), meta_info in SGLang's key order, error bodies, SSE frames."""

import json

from starlette.responses import Response

from services.engine import routing
from services.engine.batch import Sequence


def dumps(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def json_response(value, status: int = 200) -> Response:
    return Response(dumps(value), status_code=status, media_type="application/json")


def error(message: str, status: int = 400) -> Response:
    return json_response({"error": {"message": message}}, status)


def control(success: bool, message: str, **extra) -> Response:
    return json_response({"success": success, "message": message, **extra}, 200 if success else 400)


def version_spans(seq: Sequence) -> list[dict]:
    spans: list[dict] = []
    for index, version in enumerate(seq.versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    return spans


def generate_output(seq: Sequence, text: str, version: str, return_logprob: bool, latency_s: float) -> dict:
    """One element of /generate's answer, or one streamed chunk (cumulative, as SGLang streams by default)."""
    finished = seq.finish is not None
    meta = {"id": seq.rid, "finish_reason": seq.finish, "prompt_tokens": len(seq.prompt_ids)}
    meta["weight_version"] = seq.versions[-1] if seq.versions else version
    meta["num_retractions"] = seq.num_retractions
    if return_logprob:
        start = len(seq.prompt_ids) - len(seq.input_logprobs)
        meta["input_token_logprobs"] = [
            [lp, seq.prompt_ids[start + i], None] for i, lp in enumerate(seq.input_logprobs)
        ]
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(seq.output_logprobs, seq.output_ids, strict=True)
        ]
        meta["output_token_logprobs_length"] = len(seq.output_ids)
    meta.update(reasoning_tokens=0, completion_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens)
    if finished:
        meta["weight_versions"] = version_spans(seq)
        if seq.return_routed_experts and seq.routed_experts:  # none for one aborted before its prefill
            num_tokens = len(seq.prompt_ids) + len(seq.output_ids)
            meta["routed_experts"] = routing.encode(seq.routed_experts, seq.routed_experts_start_len, num_tokens)
        meta["e2e_latency"] = latency_s
    return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}


def sse(value) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
