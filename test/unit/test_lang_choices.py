"""``select``'s choice methods on random logprobs vs independent reference computations."""

from __future__ import annotations

import math
import random

import pytest

from sglang.lang.choices import (
    greedy_token_selection,
    mean_logprob,
    token_length_normalized,
    unconditional_likelihood_normalized,
)


def _random_case(rng: random.Random, n: int, tie: bool = False):
    choices = [f"choice{i}" for i in range(n)]
    lps = [[[-rng.uniform(0.01, 6.0), rng.randrange(1000), None] for _ in range(rng.randint(1, 5))] for _ in range(n)]
    if tie:  # two choices share their first tokens, so the greedy method must look further
        i, j = rng.sample(range(n), 2)
        k = min(len(lps[i]), len(lps[j]))
        for t in range(k - 1):
            lps[j][t][0] = lps[i][t][0]
    uncond = [[[None, x[0][1], None]] + [[-rng.uniform(0.01, 6.0), e[1], None] for e in x[1:]] for x in lps]
    return choices, lps, uncond


@pytest.mark.parametrize("trial", range(20))
def test_methods_match_reference(trial):
    rng = random.Random(random.randrange(1 << 30))
    n = rng.randint(2, 6)
    choices, lps, uncond = _random_case(rng, n, tie=trial % 2 == 1)
    means = [mean_logprob(x) for x in lps]
    kw = dict(choices=choices, normalized_prompt_logprobs=means, input_token_logprobs=lps,
              output_token_logprobs=[None] * n, unconditional_token_logprobs=uncond)

    ref_mean = [sum(e[0] for e in x) / len(x) for x in lps]
    best = max(range(n), key=lambda i: (ref_mean[i], -i))
    d = token_length_normalized(**kw)
    assert d.decision == choices[best] and d.meta_info["normalized_prompt_logprobs"] == pytest.approx(ref_mean)

    # greedy filtering over rows padded with their own mean == lexicographic maximum (earliest on ties)
    width = max(len(x) for x in lps)
    rows = [[e[0] for e in x] + [ref_mean[i]] * (width - len(x)) for i, x in enumerate(lps)]
    best = max(range(n), key=lambda i: (rows[i], -i))
    assert greedy_token_selection(**kw).decision == choices[best]

    pmi = [sum(c[0] - (u[0] or 0.0) for c, u in zip(x, ux)) / len(x) for x, ux in zip(lps, uncond)]
    best = max(range(n), key=lambda i: (pmi[i], -i))
    d = unconditional_likelihood_normalized(**kw)
    assert d.decision == choices[best]
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx(pmi)


def test_edge_cases():
    assert mean_logprob([[None, 1, None]]) == -math.inf
    assert unconditional_likelihood_normalized.requires_unconditional_logprobs
    assert not token_length_normalized.requires_unconditional_logprobs
    with pytest.raises(ValueError, match="unconditional"):
        unconditional_likelihood_normalized(choices=["a"], normalized_prompt_logprobs=[-1.0],
                                            input_token_logprobs=[[[-1.0, 1, None]]], output_token_logprobs=[None])
    with pytest.raises(ValueError, match="entries for 2 choices"):
        token_length_normalized(choices=["a", "b"], normalized_prompt_logprobs=[-1.0],
                                input_token_logprobs=[[]], output_token_logprobs=[None])
