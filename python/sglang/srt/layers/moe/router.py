"""Top-k softmax routing of tokens to experts.

Reference: Shazeer et al., "Outrageously Large Neural Networks: The
Sparsely-Gated Mixture-of-Experts Layer" (2017), sec. 2.1; Mixtral (Jiang et
al., 2024, sec. 2.1) renormalizes the top-k probabilities, Qwen2-MoE makes it
optional (``norm_topk_prob``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's ``top_k`` experts by softmax probability.

    Args:
        router_logits: [N, E] any float dtype.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the chosen probabilities by their sum (so they sum to 1).
    Returns:
        topk_weights [N, top_k] fp32 (softmax over all E experts in fp32, then
        optionally renormalized), topk_ids [N, top_k] int64, both on the logits'
        device, ordered by decreasing weight.
    Raises:
        ValueError: top_k outside ``[1, E]`` or logits not 2-D.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [N, E], got shape {tuple(router_logits.shape)}")
    n_exp = router_logits.shape[1]
    if not 1 <= top_k <= n_exp:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={n_exp}]")
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
