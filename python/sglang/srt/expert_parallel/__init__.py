"""Expert parallelism by all-to-all (``--moe-a2a-backend nccl|tdist``): the deployment surface (:mod:`.deploy`) and
the install of one token dispatcher per rank on a built model (:mod:`.install`). The dispatcher itself lives in
:mod:`sglang.srt.layers.moe.token_dispatcher`, the MoE stages in :mod:`sglang.srt.layers.moe.ep_a2a`."""
