"""Top-k softmax routing of tokens to experts.

Reference: Shazeer et al., "Outrageously Large Neural Networks: The
Sparsely-Gated Mixture-of-Experts Layer" (2017), sec. 2.1; Mixtral (Jiang et
al., 2024, sec. 2.1) renormalizes the top-k probabilities, Qwen2-MoE makes it
optional (``norm_topk_prob``).
"""

from __future__ import annotations

from sglang.srt.ops_ref import select_experts  # noqa: F401  (re-exported)
