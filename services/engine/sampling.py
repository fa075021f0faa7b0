"""SGLang's `sampling_params`: parsing with SGLang's defaults and checks, and choosing the next token.

Log-probs are what SGLang returns by default: log_softmax(logits / temperature) of the chosen token, taken before
top-k/top-p/min-p truncation (a greedy request uses temperature 1 for them, as SGLang does).
"""

from dataclasses import dataclass, field

import torch

from services.engine.transfer import to_device

GREEDY_BELOW = 1e-6
# Keys SGLang accepts; the ones this engine implements are fields of SamplingParams below.
IGNORED_DEFAULTS = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "stream_interval": None,
    "logit_bias": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "custom_params": None,
    "beam_width": None,
}


class BadRequest(ValueError):
    """A request SGLang would refuse with HTTP 400; `body` is SGLang's error JSON for it."""

    def __init__(self, message: str, body: dict | None = None):
        super().__init__(message)
        self.body = body if body is not None else {"error": {"message": message}}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


_FIELDS = set(SamplingParams.__dataclass_fields__)


def parse_sampling(raw: dict | None) -> SamplingParams:
    """SamplingParams from a request's dict, or BadRequest with SGLang's message and shape."""
    raw = raw or {}
    unknown = [key for key in raw if key not in _FIELDS and key not in IGNORED_DEFAULTS]
    if unknown:
        expected = ", ".join(f"`{k}`" for k in sorted(_FIELDS | set(IGNORED_DEFAULTS)))
        raise BadRequest(
            f"unknown field `{unknown[0]}`", {"error": f"unknown field `{unknown[0]}`, expected one of {expected}"}
        )
    for key, default in IGNORED_DEFAULTS.items():
        if raw.get(key) not in (None, default):
            raise BadRequest(f"sampling param {key} is not supported by the slipstream reference engine")
    values = {k: v for k, v in raw.items() if k in _FIELDS and v is not None}
    for key in ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed"):
        if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int)):
            raise BadRequest(
                f"invalid type: {key} must be an integer, got {values[key]!r}",
                {"error": f"invalid type: floating point `{values[key]}`, expected i64"},
            )
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    if "stop_token_ids" in values:
        values["stop_token_ids"] = set(values["stop_token_ids"])
    params = SamplingParams(**values)
    _verify(params)
    return params


def _verify(p: SamplingParams) -> None:
    checks = [
        (p.max_new_tokens >= 0, f"max_new_tokens must be at least 0, got {p.max_new_tokens}."),
        (p.temperature >= 0, f"temperature must be non-negative, got {p.temperature}."),
        (0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}."),
        (p.top_k == -1 or p.top_k >= 1, f"top_k must be -1 (disable), or at least 1, got {p.top_k}."),
        (0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}."),
        (
            0 <= p.min_new_tokens <= p.max_new_tokens,
            f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}.",
        ),
        (len(p.stop) <= 32, "stop may hold at most 32 strings."),
        (p.n >= 1, f"n must be at least 1, got {p.n}."),
    ]
    for ok, message in checks:
        if not ok:
            raise BadRequest(message)


def choose_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> tuple[torch.Tensor, ...]:
    """The next token of each row of `logits` [rows, vocab] and its log-prob, as two tensors [rows] on the logits'
    device (read by the engine thread later: no sync here). Greedy rows are decided in one pass and sampled rows in
    another; a row with its own generator (a `sampling_seed`) draws alone, from that generator."""
    distinct = {id(p): p for p in params}.values()  # a request's samples share theirs: a few objects a batch
    if not any(p.greedy for p in distinct) and not any(generators):  # the usual batch: one pass over all rows
        return sample(logits, params, cut=any(_cuts(p) for p in distinct))
    greedy, shared, seeded = [], [], []
    for i, (p, generator) in enumerate(zip(params, generators, strict=True)):
        (greedy if p.greedy else shared if generator is None else seeded).append(i)
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    logprobs = torch.empty(len(params), dtype=torch.float32, device=logits.device)
    if greedy:
        index = column(greedy, logits.device, torch.long)[:, 0]
        rows = logits[index].float()
        tokens[index] = best = rows.argmax(-1)
        logprobs[index] = torch.log_softmax(rows, -1).gather(1, best[:, None])[:, 0]
    groups = [(shared, None)] if shared else []
    groups += [([i], generators[i]) for i in seeded]
    for rows, generator in groups:
        index = column(rows, logits.device, torch.long)[:, 0]
        tokens[index], logprobs[index] = sample(logits[index], [params[i] for i in rows], generator)
    return tokens, logprobs


def sample(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator | None = None,
           cut: bool | None = None):  # fmt: skip
    """Draws a token for each row [rows, vocab] from softmax(logits / temperature), cut by each row's top-k, top-p and
    min-p, in one pass for all rows; returns the tokens and their log-probs [rows]. The draw is an exponential race
    (the argmax of p / E with E ~ Exp(1), which picks each token with probability p): a few passes over the rows,
    where `torch.multinomial` costs a scan per row. `cut`: whether any row has a top-k, top-p or min-p (worked out
    here when not given)."""
    logits = logits.float()
    temperature = column([p.temperature for p in params], logits.device)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    if generator is None:
        race = torch.empty_like(logprobs).exponential_()
    else:  # a request's own generator lives on the CPU
        race = torch.empty(logprobs.shape, device=generator.device).exponential_(generator=generator)
        race = race.to(logprobs.device)
    if cut if cut is not None else any(_cuts(p) for p in params):
        tokens = (truncate(logprobs.exp(), params) / race).argmax(-1, keepdim=True)
    else:
        tokens = (logprobs - race.log_()).argmax(-1, keepdim=True)
    return tokens[:, 0], logprobs.gather(1, tokens)[:, 0]


def plain(params: SamplingParams, generator) -> bool:
    """Whether a sequence's tokens can be drawn by `pick`: greedy, or with no top-k, top-p or min-p cut and no
    generator of its own; and no EOS to hold back for min_new_tokens."""
    drawn = params.greedy or not (_cuts(params) or generator is not None)
    return drawn and (params.min_new_tokens == 0 or params.ignore_eos)


def pick_temperature(params: SamplingParams) -> float:
    """A plain sequence's entry in `pick`'s temperatures: its temperature, 0 for greedy."""
    return 0.0 if params.greedy else params.temperature


def pick(logits: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token and its log-prob for rows of plain sequences (`plain`), from logits [rows, vocab] and each
    row's temperature [rows] (0: greedy), with no host values: what a CUDA graph of the decode step captures with the
    forward (services/engine/batch.py). The same draw as `sample` and the same greedy choice as `choose_batch`."""
    logits = logits.float()
    greedy = temperatures == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperatures)[:, None], dim=-1)
    race = torch.empty_like(logprobs).exponential_()
    tokens = torch.where(greedy, logits.argmax(-1), (logprobs - race.log()).argmax(-1))
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _cuts(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0


def column(values: list, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """`values` as a column [rows, 1] on `device` (services/engine/transfer.py)."""
    return to_device(torch.tensor(values, dtype=dtype), device)[:, None]


def truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's probabilities [rows, vocab] with what its top-k, top-p and min-p leave out set to zero."""

    def rows(values, dtype=torch.float32):
        return column(values, probs.device, dtype)

    vocab = probs.shape[-1]
    if any(p.top_k > 0 for p in params):
        ks = [min(p.top_k, vocab) if p.top_k > 0 else 1 for p in params]
        kth = torch.topk(probs, max(ks), dim=-1).values.gather(1, rows(ks, torch.long) - 1)
        probs = torch.where((probs < kth) & rows([p.top_k > 0 for p in params], torch.bool), 0.0, probs)
    if any(p.top_p < 1.0 for p in params):
        ordered, index = torch.sort(probs, dim=-1, descending=True)
        outside = torch.cumsum(ordered, -1) - ordered > rows([p.top_p for p in params]) * ordered.sum(-1, True)
        outside &= rows([p.top_p < 1.0 for p in params], torch.bool)
        probs = probs.scatter(-1, index, torch.where(outside, 0.0, ordered))
    if any(p.min_p > 0 for p in params):
        probs = torch.where(probs < rows([p.min_p for p in params]) * probs.amax(-1, True), 0.0, probs)
    return probs
