"""nanoexp's model for EleutherAI's lm-evaluation-harness, registered as `nanoexp`: the harness's requests turned
into token rows, scored by the sharded model (scorer.py) in whatever layout it runs.

Tokenisation follows the harness's own Hugging Face model (`--model hf`), so that a nanoexp checkpoint and its
Hugging Face export score alike: a (context, continuation) pair is encoded whole and the continuation is what the
whole adds to the context (whitespace at the context's end moves to the continuation first); an empty context
becomes the end-of-document token; a row keeps the last `tokens.sequence_length` tokens. Rolling log-likelihoods
score a text in the harness's disjoint windows (`lm_eval.utils.get_rolling_token_windows`). Generation is greedy:
the context's last sequence_length - max_gen_toks tokens, then up to `max_gen_toks` tokens, each a forward of the
whole row (no KV cache across shards), cut at the first `until` string or the end-of-document token.

Every rank runs the harness over every request (the model says rank 0 of 1 to the harness, which so never
splits requests itself); the scorer shares the forwards out over the ranks, and every rank gets every score.
"""
from __future__ import annotations

import lm_eval.models  # noqa: F401 - the harness's own models (hf, ...): its registry loads them only while empty
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nanoexp.data.loader import IGNORE_INDEX
from nanoexp.evaluation.scorer import Row

DEFAULT_MAX_GEN_TOKS = 256   # the harness's Hugging Face model's default


@register_model("nanoexp")
class NanoexpLM(LM):
    """The harness's view of a ShardedScorer and a nanoexp tokenizer; `batch_size`: rows scored per call."""

    def __init__(self, scorer, tokenizer, batch_size: int = 32):
        super().__init__()
        self.scorer, self.tokenizer, self.batch_size = scorer, tokenizer, batch_size
        self.max_length = scorer.sequence_length

    # -- log-likelihoods ----------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids), as the harness's Hugging Face model splits them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.tokenizer.eod_id], self.tokenizer.encode(continuation)
        whole, head = self.tokenizer.encode(context + continuation), self.tokenizer.encode(context)
        return head, whole[len(head):]

    def row(self, context: list[int], continuation: list[int]) -> Row:
        """The last sequence_length + 1 tokens, as inputs and targets, the continuation's targets scored."""
        tokens = (context + continuation)[-(self.max_length + 1):]
        scored = min(len(continuation), len(tokens) - 1)
        labels = [IGNORE_INDEX] * (len(tokens) - 1 - scored) + tokens[len(tokens) - scored:]
        return Row(tokens[:-1], labels)

    def score_rows(self, rows: list[Row]):
        """Scores of `rows`, batch_size rows per scorer call."""
        out = []
        for start in range(0, len(rows), self.batch_size):
            out += self.scorer.score(rows[start:start + self.batch_size]).tolist()
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        rows = [self.row(*self.encode_pair(*request.args)) for request in requests]
        return [(logprob, mismatches == 0) for logprob, mismatches, _ in self.score_rows(rows)]

    def loglikelihood_rolling(self, requests) -> list[float]:
        rows, owner = [], []
        for n, request in enumerate(requests):
            windows = get_rolling_token_windows(token_list=self.tokenizer.encode(request.args[0]),
                                                prefix_token=self.tokenizer.eod_id, max_seq_len=self.max_length,
                                                context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                rows.append(self.row(context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _, _) in zip(owner, self.score_rows(rows)):
            totals[n] += logprob
        return totals

    # -- generation ---------------------------------------------------------------------------------
    def generate_until(self, requests) -> list[str]:
        out = []
        for start in range(0, len(requests), self.batch_size):
            out += self.generate_batch([request.args for request in requests[start:start + self.batch_size]])
        return out

    def generate_batch(self, args: list[tuple[str, dict]]) -> list[str]:
        """Greedy continuations of a batch of (context, generation kwargs), each cut at its first `until`."""
        stops = [stop_strings(kwargs) for _, kwargs in args]
        most = max(int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)) for _, kwargs in args)
        # As the harness's Hugging Face model: a context keeps its last max_length - max_gen_toks tokens.
        keep = max(1, self.max_length - most)
        contexts = [(self.tokenizer.encode(context) or [self.tokenizer.eod_id])[-keep:] for context, _ in args]
        generated, done = [[] for _ in args], [False] * len(args)
        for _ in range(most):
            live = [n for n, finished in enumerate(done) if not finished]
            if not live:
                break
            rows = []
            for n in live:   # the last sequence_length tokens; the next token is read at the last position
                tokens = (contexts[n] + generated[n])[-self.max_length:]
                rows.append(Row(tokens, [IGNORE_INDEX] * (len(tokens) - 1) + [0]))
            for n, (_, _, token) in zip(live, self.score_rows(rows)):
                generated[n].append(int(token))
                text = self.tokenizer.decode(generated[n])
                limit = int(args[n][1].get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
                done[n] = (int(token) == self.tokenizer.eod_id or len(generated[n]) >= limit
                           or any(stop in text for stop in stops[n]))
        return [cut(self.tokenizer.decode([t for t in tokens if t != self.tokenizer.eod_id]), stop)
                for tokens, stop in zip(generated, stops)]


def stop_strings(kwargs: dict) -> list[str]:
    until = kwargs.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def cut(text: str, stops: list[str]) -> str:
    """`text` up to the first occurrence of any of `stops`."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text
