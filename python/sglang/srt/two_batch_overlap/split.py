"""Where two-batch overlap cuts a batch into its two micro-batches (pure host arithmetic, no torch).

The rules are SGLang's ``--enable-two-batch-overlap`` rules (LMSYS, "Deploying DeepSeek with PD Disaggregation and
Large-scale Expert Parallelism", 2025; DeepSeek-V3 technical report, sec. 3.4, dual micro-batch overlap), written
here from their description:

* **decode**: by requests, half and half (every request is one token, so this balances the token counts);
* **extend / prefill** (and mixed prefill + decode batches): first the request boundary that best balances the two
  sides' token counts; when even that boundary leaves one side with less than ``threshold`` of the tokens
  (``--tbo-token-distribution-threshold``, default 0.48, in ``[0, 0.5]``), the batch is cut by *tokens* at its
  half instead, so one request straddles the cut: its first part runs in micro-batch A, the rest continues in B as
  an extend over A's KV (:mod:`sglang.srt.batch_split`). ``threshold = 0`` never cuts inside a request.

A batch that cannot leave tokens on both sides (one request in decode, one token) is not split. Whether a batch is
large enough to be worth splitting is decided elsewhere (:mod:`.auto_off`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD = 0.48  # SGLang's default of --tbo-token-distribution-threshold


@dataclass(frozen=True)
class MicroBatchSplit:
    """The cut of one batch into micro-batches A (flat new tokens ``[0, token_cut)``) and B (``[token_cut, N)``).

    Attributes:
        token_cut: the first token of B, in ``[1, N-1]``.
        num_tokens: N, the batch's new tokens.
        by: ``"requests"`` (the cut is a request boundary) or ``"tokens"`` (the token-distribution rule cut at the
            half of the tokens; the cut may still fall on a boundary).
        straddling: index of the request cut in two (its tokens are in both micro-batches), or None.
    """

    token_cut: int
    num_tokens: int
    by: str
    straddling: Optional[int] = None

    @property
    def tokens_a(self) -> int:
        """Tokens of micro-batch A."""
        return self.token_cut

    @property
    def tokens_b(self) -> int:
        """Tokens of micro-batch B."""
        return self.num_tokens - self.token_cut

    def describe(self) -> str:
        """``"2048 + 2048 tokens, by tokens (request 3 straddles)"`` for logs."""
        s = f"{self.tokens_a} + {self.tokens_b} tokens, by {self.by}"
        return s + (f" (request {self.straddling} straddles)" if self.straddling is not None else "")


def check_threshold(threshold: float) -> None:
    """Raise ValueError unless ``0 <= threshold <= 0.5`` (a token-distribution threshold)."""
    if not 0.0 <= threshold <= 0.5:
        raise ValueError(f"--tbo-token-distribution-threshold={threshold!r} is invalid: use a fraction in [0, 0.5] "
                         "(0: never cut inside a request; SGLang's default 0.48)")


def balanced_request_cut(extend_lens: Sequence[int]) -> int:
    """The request index ``i`` in ``[1, n-1]`` minimizing ``|sum(lens[:i]) - sum(lens[i:])|`` (ties: the later
    index), or 0 when there is one request or none. ``extend_lens``: new tokens per request (each >= 1)."""
    n = len(extend_lens)
    if n < 2:
        return 0
    total, left = sum(extend_lens), 0
    best, best_diff = 0, None
    for i in range(1, n):
        left += extend_lens[i - 1]
        diff = abs(2 * left - total)
        if best_diff is None or diff <= best_diff:
            best, best_diff = i, diff
    return best


def request_of_token(extend_lens: Sequence[int], token: int) -> tuple[int, int]:
    """``(request index, offset of its first token)`` of the request holding flat token ``token``.

    Raises:
        ValueError: ``token`` is outside ``[0, sum(extend_lens))``.
    """
    start = 0
    for i, e in enumerate(extend_lens):
        if start <= token < start + e:
            return i, start
        start += e
    raise ValueError(f"token {token} is outside the batch's {start} tokens")


def split_extend(extend_lens: Sequence[int], threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD
                 ) -> Optional[MicroBatchSplit]:
    """The cut of an extend (prefill, or mixed prefill + decode) batch with ``extend_lens`` new tokens per request
    (see the module docstring), or None when no cut leaves tokens on both sides.

    Raises:
        ValueError: ``threshold`` outside ``[0, 0.5]``, or a request with no new tokens.
    """
    check_threshold(threshold)
    if any(e < 1 for e in extend_lens):
        raise ValueError(f"split_extend: every request needs new tokens, got extend_lens={list(extend_lens)}")
    total = sum(extend_lens)
    if total < 2:
        return None
    seq = balanced_request_cut(extend_lens)
    left = sum(extend_lens[:seq])
    if threshold > 0 and not threshold * total <= left <= (1 - threshold) * total:
        cut = total // 2
        req, start = request_of_token(extend_lens, cut)
        return MicroBatchSplit(cut, total, "tokens", req if cut > start else None)
    if seq == 0:
        return None
    return MicroBatchSplit(left, total, "requests")


def split_decode(batch_size: int) -> Optional[MicroBatchSplit]:
    """The cut of a decode batch of ``batch_size`` requests (one token each): A takes ``ceil(bs / 2)`` requests, B
    the rest (SGLang gives A the floor; either way the sides differ by at most one token), or None below 2."""
    if batch_size < 2:
        return None
    a = (batch_size + 1) // 2
    return MicroBatchSplit(a, batch_size, "requests")


def plan_micro_batches(is_decode: bool, extend_lens: Sequence[int],
                       threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD) -> Optional[MicroBatchSplit]:
    """The two-micro-batch cut of a batch: :func:`split_decode` for decode batches, else :func:`split_extend`.
    ``extend_lens``: new tokens per request (decode: all 1). Raises ValueError as :func:`split_extend`."""
    if is_decode:
        check_threshold(threshold)
        return split_decode(len(extend_lens))
    return split_extend(extend_lens, threshold)
