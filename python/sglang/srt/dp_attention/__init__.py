"""SGLang's data-parallel attention (``--enable-dp-attention --dp-size N --tp-size N``) for MoE models.

Source: the LMSYS blog on SGLang's DP attention for DeepSeek's MLA (2025) and DeepSeek-V3's deployment (technical
report, sec. 3.4): attention runs data parallel (every rank holds the attention and dense weights, its own requests
and its own KV cache, so the KV cache is not duplicated over TP ranks), the MoE layers run expert parallel over all
ranks.

Pieces (each small, each tested on its own):

* :mod:`.deploy`: the technique surface of the deployment plan (flag combinations, one worker per DP rank, the
  model check).
* :mod:`sglang.srt.managers.dp_router`: the front end's choice of DP rank per request (``--load-balance-method``:
  shortest queue or round robin; aborts follow their request; the same router serves AFD's attention workers).
* :mod:`.step_sync`: the per-step agreement of the DP ranks (one CPU all-gather of ``[tokens, has work, graph
  batch]``): whether anyone runs a forward, which ranks run an idle one, and the padded decode CUDA-graph batch.
* :mod:`.moe`: the model layout (experts sharded over the DP world on a replicated-attention model) and the MoE
  token exchange of ``--moe-a2a-backend none`` (all-gather every rank's tokens padded to the step's largest count,
  the local experts, reduce-scatter back), and the idle forward that keeps the collectives matched.
* :mod:`.scheduler_hook`: the scheduler's side of the agreement (idle batches).
* :mod:`.rank`: one worker's DP state (the torch.distributed world, the step-agreement group, the per-forward
  padding) that the scheduler process, the model runner and the scheduler share.
"""
