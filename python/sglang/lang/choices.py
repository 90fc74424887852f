"""How ``select`` turns per-choice token logprobs into a decision (SGLang's ``choices_method``).

A backend scores every choice ``c`` as the continuation of the program's text: for each choice it
returns the input-token logprobs of ``c``'s tokens (``[logprob, token_id, token_text]`` entries;
with token healing the first entry may be a merged boundary token) and their mean
(``normalized_prompt_logprobs``). A method picks one choice from those numbers:

- :data:`token_length_normalized` (default): the highest mean logprob per token.
- :data:`greedy_token_selection`: token-by-token greedy: keep the choices whose first token has the
  highest logprob, among them those whose second token is best, ...; a choice that ran out of tokens
  is padded with its own mean logprob.
- :data:`unconditional_likelihood_normalized`: the highest mean of ``logprob(token | prompt) -
  logprob(token | choice's preceding tokens only)``, which corrects for choices that are likely
  regardless of the prompt (Holtzman et al. 2021, "Surface Form Competition", PMI_DC scoring).
  Needs a second scoring pass of the choices without the prompt
  (:attr:`ChoicesSamplingMethod.requires_unconditional_logprobs`).

Ties go to the earliest choice.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

LogprobEntry = Sequence[Any]  # [logprob (float or None), token_id, token_text or None]


@dataclass
class ChoicesDecision:
    """The chosen string and the numbers behind it (``state.get_meta_info(name)``)."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def mean_logprob(entries: Sequence[LogprobEntry]) -> float:
    """Mean of the non-None logprobs of ``entries``; ``-inf`` when there are none."""
    vals = [e[0] for e in entries if e[0] is not None]
    return sum(vals) / len(vals) if vals else -math.inf


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _check(choices: Sequence[str], per_choice: Sequence[Any], what: str) -> None:
    if len(per_choice) != len(choices):
        raise ValueError(f"{what} has {len(per_choice)} entries for {len(choices)} choices")


class ChoicesSamplingMethod:
    """Base class: ``method(choices=..., normalized_prompt_logprobs=..., input_token_logprobs=...,
    output_token_logprobs=..., unconditional_token_logprobs=...) -> ChoicesDecision``."""

    requires_unconditional_logprobs = False

    def __call__(self, *, choices: Sequence[str], normalized_prompt_logprobs: Sequence[float],
                 input_token_logprobs: Sequence[Sequence[LogprobEntry]],
                 output_token_logprobs: Sequence[Any],
                 unconditional_token_logprobs: Optional[Sequence[Sequence[LogprobEntry]]] = None,
                 ) -> ChoicesDecision:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    """Pick the choice with the highest mean logprob per token (SGLang's default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        _check(choices, normalized_prompt_logprobs, "normalized_prompt_logprobs")
        best = _argmax(list(normalized_prompt_logprobs))
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": list(normalized_prompt_logprobs),
            "input_token_logprobs": [list(x) for x in input_token_logprobs],
            "output_token_logprobs": list(output_token_logprobs),
        })


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token-by-token greedy choice: filter the candidates by the best logprob at token 0, then 1, ...

    A choice shorter than the longest one is padded with its own mean logprob, so a short choice
    is not eliminated merely for having ended.
    """

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        _check(choices, input_token_logprobs, "input_token_logprobs")
        rows = []
        for entries in input_token_logprobs:
            vals = [e[0] for e in entries if e[0] is not None]
            rows.append(vals)
        width = max((len(r) for r in rows), default=0)
        matrix = []
        for vals in rows:
            pad = sum(vals) / len(vals) if vals else -math.inf
            matrix.append(vals + [pad] * (width - len(vals)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], {
            "normalized_prompt_logprobs": list(normalized_prompt_logprobs),
            "input_token_logprobs": [list(x) for x in input_token_logprobs],
            "output_token_logprobs": list(output_token_logprobs),
            "greedy_logprob_matrix": matrix,
        })


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Pick the highest mean of ``conditional - unconditional`` token logprobs (PMI-style).

    The unconditional logprob of a choice's first token has no context and is None; it counts as 0.
    """

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs "
                             "(the backend must run the unconditional scoring pass)")
        _check(choices, input_token_logprobs, "input_token_logprobs")
        _check(choices, unconditional_token_logprobs, "unconditional_token_logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError(f"conditional ({len(cond)}) and unconditional ({len(uncond)}) logprobs of a "
                                 "choice must cover the same tokens")
            diffs = [(c[0] if c[0] is not None else 0.0) - (u[0] if u[0] is not None else 0.0)
                     for c, u in zip(cond, uncond)]
            scores.append(sum(diffs) / len(diffs) if diffs else -math.inf)
        best = _argmax(scores)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": list(normalized_prompt_logprobs),
            "input_token_logprobs": [list(x) for x in input_token_logprobs],
            "output_token_logprobs": list(output_token_logprobs),
            "unconditional_token_logprobs": [list(x) for x in unconditional_token_logprobs],
            "normalized_unconditional_prompt_logprobs": scores,
        })


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
