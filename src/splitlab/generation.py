"""Continuing a prompt with a language model, and scoring continuations against references.

Decoding (`splitlab generate`, `eval_generate`): greedy; sampling from softmax(logits / T),
optionally restricted to the k most likely tokens (top-k) and to the smallest set of most likely
tokens whose probability reaches p (top-p, nucleus), top-k first, as transformers applies them;
or beam search. The model is a function from token ids (B, T) to logits (B, T, V); it sees the
last `window` tokens (the run's `seq_len`, the longest sequence it trained on), so a continuation
may be longer than its context. Decoding is written here rather than taken from transformers'
`generate`, because that one grows the context without a window (past `model=gpt`'s positions)
and would need each split model converted first; the filters are checked against transformers'
own (tests/language/test_generation.py).

Scores (`eval_generate`): corpus BLEU by sacrebleu (its default 13a tokenisation, every reference
of a prompt), and ROUGE-L by Google's rouge-score (F-measure of the longest common subsequence,
the best over a prompt's references, averaged over prompts), the two metrics of the E2E challenge.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitlab.config import DecodingSettings
from splitlab.errors import UserError

Logits = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def decode(
    model: Logits, prompt: list[int], settings: DecodingSettings, window: int, eos: int | None = None
) -> list[int]:
    """The tokens that continue `prompt`, up to `settings.max_new_tokens`; generation stops at `eos`
    (not returned)."""
    if settings.num_beams > 1:
        return beam_search(model, prompt, settings.num_beams, settings.max_new_tokens, window, eos)
    generator = torch.Generator().manual_seed(settings.seed)
    produced: list[int] = []
    for _ in range(settings.max_new_tokens):
        logits = next_scores(model, torch.tensor([(prompt + produced)[-window:]]))[0]
        token = int(logits.argmax()) if settings.temperature == 0 else sample(logits, settings, generator)
        if token == eos:
            break
        produced.append(token)
    return produced


def next_scores(model: Logits, contexts: torch.Tensor) -> torch.Tensor:
    """The model's scores for the token after each context; NaN scores come from weights that are
    not numbers and choose no token (argmax over NaN is arbitrary: a silently wrong generation)."""
    logits = model(contexts)[:, -1]
    if bool(torch.isnan(logits).any()):
        raise UserError("the model's next-token scores are NaN: its weights are not finite numbers")
    return logits


def sample(logits: torch.Tensor, settings: DecodingSettings, generator: torch.Generator) -> int:
    """One token drawn from softmax(logits / T) restricted by top-k, then top-p. A temperature so
    small that the largest logit / T overflows (T = 1e-40 in float32) gives the distribution's
    limit as T -> 0, all its mass on the most likely token: the greedy choice."""
    scaled = logits / settings.temperature
    if not bool(torch.isfinite(scaled.max())):
        return int(logits.argmax())
    scaled = filtered(scaled, settings.top_k, settings.top_p)
    return int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator))


def filtered(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """`logits` (V,) with -inf outside the k most likely tokens (ties with the k-th kept), then
    outside the fewest most likely tokens whose probability reaches p (at least one): the least
    likely tokens whose probabilities sum to at most 1 - p are dropped, as transformers does."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, len(logits))).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None:
        ascending, order = logits.sort()
        beyond = torch.softmax(ascending, -1).cumsum(-1) <= 1 - top_p  # the least likely, within 1 - p in all
        beyond[-1] = False
        logits = logits.masked_fill(torch.empty_like(beyond).scatter(0, order, beyond), -torch.inf)
    return logits


def beam_search(
    model: Logits, prompt: list[int], num_beams: int, max_new_tokens: int, window: int, eos: int | None = None
) -> list[int]:
    """The continuation of highest mean log-probability per token among `num_beams` beams: each step
    extends every beam by every token and keeps the `num_beams` best sums that do not end; one that
    ends (`eos`, counted as a token) is set aside, and the search stops once `num_beams` have ended
    or after `max_new_tokens` tokens."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]  # (tokens, sum of log-probabilities)
    ended: list[tuple[list[int], float, int]] = []  # (tokens, sum, length scored)
    for _ in range(max_new_tokens):
        contexts = torch.tensor([(prompt + tokens)[-window:] for tokens, _ in beams])
        sums = torch.tensor([s for _, s in beams])[:, None]
        scores = torch.log_softmax(next_scores(model, contexts).float(), -1) + sums
        top = scores.flatten().topk(min(2 * num_beams, scores.numel()))
        kept: list[tuple[list[int], float]] = []
        for score, index in zip(top.values.tolist(), top.indices.tolist()):
            beam, token = divmod(index, scores.shape[1])
            if token == eos:
                ended.append((beams[beam][0], score, len(beams[beam][0]) + 1))
            else:
                kept.append((beams[beam][0] + [token], score))
            if len(kept) == num_beams:
                break
        beams = kept
        if len(ended) >= num_beams:
            break
    candidates = ended if len(ended) >= num_beams else ended + [(tokens, s, len(tokens)) for tokens, s in beams]
    return max(candidates, key=lambda candidate: candidate[1] / candidate[2])[0]


def text_scores(hypotheses: list[str], references: list[list[str]]) -> dict[str, float]:
    """Corpus BLEU (0-100, sacrebleu) of `hypotheses` against every reference of each, and the mean
    over hypotheses of ROUGE-L's F-measure (0-1, rouge-score, the best over its references)."""
    import sacrebleu
    from rouge_score import rouge_scorer

    most = max(len(refs) for refs in references)  # sacrebleu takes reference streams: None where a prompt has fewer
    streams = [[refs[i] if i < len(refs) else None for refs in references] for i in range(most)]
    bleu = sacrebleu.corpus_bleu(hypotheses, streams).score  # type: ignore[arg-type]  # None: no such reference
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = [scorer.score_multi(refs, text)["rougeL"].fmeasure for text, refs in zip(hypotheses, references)]
    return {"bleu": float(bleu), "rouge_l": float(sum(rouge) / len(rouge))}
