"""Llama decoder (Touvron et al., "LLaMA", 2023, sec. 2.2: pre-norm RMSNorm, SwiGLU MLP, RoPE; GQA from
Ainslie et al. 2023) and the shared machinery the other decoders reuse.

Qwen2, Qwen3 and the MoE models subclass :class:`LlamaForCausalLM` and only
change its hooks: :meth:`LlamaForCausalLM.attention_options` (qkv/o bias,
per-head q/k norm), :meth:`LlamaForCausalLM.make_mlp` (dense MLP or MoE block)
and the weight-name tables used by :meth:`LlamaForCausalLM.load_weights`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear, materialize
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.moe.sparse_moe_block import DenseMLP, SparseMoeBlock
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from sglang.srt.layers.stages import DENSE_STAGES, MOE_STAGES, LayerState
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger(__name__)


LlamaMLP = DenseMLP  # the SwiGLU MLP (its home is the layers package, shared by the MoE blocks)


class LlamaAttention(nn.Module):
    """Self-attention: packed QKV projection, optional per-head RMSNorm of q and k (Qwen3), RoPE, paged attention.

    ``forward(positions [N], hidden [N, H], forward_batch) -> [N, H]`` (a TP partial sum when
    ``reduce_results`` is False).
    """

    def __init__(self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False, tp_rank: int = 0, tp_size: int = 1, comm: Any = None,
                 reduce_results: bool = True):
        super().__init__()
        hd, dtype = config.head_dim, config.dtype
        tp = dict(params_dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)
        self.head_dim = hd
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, **tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=o_bias,
                                        comm=comm, reduce_results=reduce_results, **tp)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(hd, eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(hd, eps, dtype) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(self.qkv_proj.num_heads, hd, hd ** -0.5, self.qkv_proj.num_kv_heads, layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch) -> torch.Tensor:
        """QKV projection, optional per-head q/k RMSNorm, RoPE at ``positions`` ``[N]`` int64, paged attention, output
        projection: hidden ``[N, H]`` -> ``[N, H]``."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        # RoPE is applied by the attention layer (fused with the KV-cache store where the backend can)
        return self.o_proj(self.attn(q, k, v, forward_batch, positions=positions, rotary_emb=self.rotary_emb))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so each norm is a fused add + RMSNorm.

    ``forward(positions, hidden, residual, forward_batch) -> (mlp_out, residual)``; pass
    ``residual=None`` to the first layer. The block's output is ``mlp_out + residual``.
    ``norm_comm``: with TP, the attention and MLP outputs are partial sums and the norms reduce them
    (fused AllReduce + add + RMSNorm, see :class:`RMSNorm`).
    Stages (:mod:`sglang.srt.layers.stages`): :meth:`stage_names` lists them and :meth:`run_stage` runs
    one on a :class:`LayerState`; running them all in order equals :meth:`forward`.
    """

    def __init__(self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, mlp: nn.Module,
                 attn_options: dict[str, Any], norm_comm: Any = None):
        super().__init__()
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.layer_id = layer_id
        self.self_attn = LlamaAttention(config, layer_id, rotary_emb, **attn_options)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, config.dtype, comm=norm_comm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, config.dtype, comm=norm_comm)

    def forward(self, positions, hidden, residual, forward_batch):
        """Pre-norm attention + MLP block: returns ``(mlp_out, residual)``, both ``[N, H]``; ``residual`` None on the
        first layer."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.is_moe:  # the batch picks the MoE all-to-all mode (stages.moe_dispatch_mode)
            return self.mlp(hidden, forward_batch), residual
        return self.mlp(hidden), residual

    # ---- stages --------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        """True when the MLP is a sparse MoE block (its stage is then route/dispatch/experts/combine)."""
        return isinstance(self.mlp, SparseMoeBlock)

    def stage_names(self) -> tuple[str, ...]:
        """The layer's stages in execution order (see :mod:`sglang.srt.layers.stages`)."""
        return DENSE_STAGES[:-1] + MOE_STAGES if self.is_moe else DENSE_STAGES

    def norm_module(self, stage: str) -> RMSNorm:
        """The RMSNorm of a norm+comm stage (``input_norm`` / ``post_attention_norm``), so an executor can run
        the fused AllReduce + add + RMSNorm itself (e.g. on a communication stream) with its weight and eps.

        Raises:
            ValueError: ``stage`` is not a norm stage.
        """
        if stage == "input_norm":
            return self.input_layernorm
        if stage == "post_attention_norm":
            return self.post_attention_layernorm
        raise ValueError(f"norm_module: {stage!r} is not a norm stage (input_norm, post_attention_norm)")

    def run_stage(self, stage: str, st: LayerState) -> None:
        """Run one stage on ``st`` (updates it in place).

        Raises:
            ValueError: an unknown stage, or an MoE stage on a dense layer (and vice versa).
        """
        if stage not in self.stage_names():
            raise ValueError(f"layer {self.layer_id}: unknown stage {stage!r}; stages are {self.stage_names()}")
        if stage in ("input_norm", "post_attention_norm"):
            norm = self.norm_module(stage)
            if st.residual is None:
                st.residual, st.hidden = st.hidden, norm(st.hidden)
            else:
                st.hidden, st.residual = norm(st.hidden, st.residual)
        elif stage == "attention":
            st.hidden = self.self_attn(st.positions, st.hidden, st.forward_batch)
        elif stage == "mlp":
            st.hidden = self.mlp(st.hidden)
        elif stage == "moe_route":
            self.mlp.route(st.hidden, st.moe)
        elif stage == "moe_dispatch":
            self.mlp.dispatch(st.moe)
        elif stage == "moe_experts":
            self.mlp.run_experts(st.moe)
        else:  # moe_combine
            st.hidden = self.mlp.combine(st.moe)


def make_rope(config: ModelConfig) -> RotaryEmbedding:
    """The model's RoPE (one cache shared by all layers) over ``config.context_len`` positions."""
    return get_rope(config.head_dim, config.head_dim, config.context_len, config.rope_theta, config.rope_scaling)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: ``forward(input_ids [N], positions [N], fb) -> [N, H]`` (normed).

    ``norm_comm``: passed to every residual norm (see :class:`LlamaDecoderLayer`).
    """

    def __init__(self, config: ModelConfig, mlps: list[nn.Module], attn_options: dict[str, Any],
                 tp_rank: int = 0, tp_size: int = 1, comm: Any = None, norm_comm: Any = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.dtype,
                                                   tp_rank, tp_size, comm)
        rope = make_rope(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rope, mlps[i], attn_options, norm_comm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps", 1e-6)), config.dtype,
                            comm=norm_comm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        """Embed ``input_ids`` ``[N]``, run every decoder layer, apply the final norm: returns hidden ``[N, H]`` in the
        model dtype."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        return self.norm(hidden, residual)[0]


# an expert's weight, or one of the FP8 tensors that come with it (sglang.srt.layers.quantization): its scale
# (``weight_scale``, per tensor / channel), block scale (``weight_scale_inv``) or static input scale (``input_scale``)
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale|weight_scale_inv|input_scale)$")


class LlamaForCausalLM(nn.Module):
    """Llama causal LM over the paged KV cache.

    Args:
        config: the model config (``attention_bias``, ``mlp_bias``,
            ``tie_word_embeddings``, ``rope_scaling`` incl. llama3 are honoured).
        tp_rank, tp_size, comm: tensor parallelism (``comm``: a
            :class:`~sglang.srt.distributed.communicator.Communicator`, required when tp_size > 1).
            With tp_size > 1 the row-parallel outputs are left as partial sums and reduced by the
            following norm's ``comm.all_reduce_add_rmsnorm``.
        ep_size: expert parallelism of MoE subclasses (a divisor of tp_size).
    ``forward(input_ids [N] int64, positions [N] int64, forward_batch) -> LogitsProcessorOutput``.
    ``load_weights(iterable of (HF name, tensor))`` (see its docstring).
    """

    # (our name piece, HF name piece, shard_id) for parameters packing several HF tensors
    stacked_params_mapping: tuple[tuple[str, str, Any], ...] = (
        (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1),
    )
    # HF expert projection name -> FusedMoE shard id (MoE subclasses set it)
    expert_weight_names: dict[str, str] = {}
    # (HF piece, our piece) renames applied before anything else
    name_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1, comm: Any = None,
                 ep_size: int = 1):
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size, self.comm, self.ep_size = tp_rank, tp_size, comm, ep_size
        self.fuse_allreduce_norm = tp_size > 1
        if config.get("sliding_window") and config.get("use_sliding_window", True) is not False:
            logger.warning("sliding_window=%s is ignored: every layer uses full attention", config.get("sliding_window"))
        mlps = [self.make_mlp(config, i) for i in range(config.num_hidden_layers)]
        self.model = LlamaModel(config, mlps, self.attention_options(config), tp_rank, tp_size, comm,
                                norm_comm=comm if self.fuse_allreduce_norm else None)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, config.dtype, tp_rank, tp_size)
        self.logits_processor = LogitsProcessor(config.vocab_size, tp_size=tp_size, comm=comm)

    # ---- hooks for subclasses -------------------------------------------------------------------------
    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        """Keyword arguments of :class:`LlamaAttention` (bias flags, qk_norm, tp)."""
        bias = bool(config.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=False, **self._tp())

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """The feed-forward module of layer ``layer_id``."""
        return LlamaMLP(config.hidden_size, config.get("intermediate_size"), bool(config.get("mlp_bias", False)),
                        config.get("hidden_act", "silu"), config.dtype, **self._tp())

    def _tp(self) -> dict[str, Any]:
        """Tensor-parallel keyword arguments of attention and MLP modules (their outputs stay partial
        sums when the norms fuse the all-reduce)."""
        return dict(tp_rank=self.tp_rank, tp_size=self.tp_size, comm=self.comm,
                    reduce_results=not self.fuse_allreduce_norm)

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> LogitsProcessorOutput:
        """``input_ids``, ``positions`` ``[N]`` int64 -> logits (and logprobs) of the rows ``forward_batch`` selects."""
        hidden = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden, self.lm_head.weight, forward_batch)

    # ---- the staged-model contract that executors use (sglang.srt.model_executor.executors) --------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``input_ids`` [T] int64 -> [T, H] in the model dtype (complete, not a partial sum)."""
        return self.model.embed_tokens(input_ids)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers, each with ``stage_names()`` / ``run_stage()``."""
        return self.model.layers

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's residual add + final RMSNorm (all-reduce fused under TP): [T, H] -> [T, H]."""
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, forward_batch) -> LogitsProcessorOutput:
        """Logits (and logprobs) of the rows ``forward_batch`` selects from the final hidden states [N, H]."""
        return self.logits_processor(hidden, self.lm_head.weight, forward_batch)

    # ---- weights ---------------------------------------------------------------------------------------
    def map_weight_name(self, name: str) -> Optional[tuple[str, Any]]:
        """HF tensor name -> (our parameter name, shard key) or None for tensors to skip.

        The shard key is None for plain parameters, the ``shard_id`` of packed
        ones, and ``(expert_id, shard_id)`` for MoE experts.
        """
        if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
            return None
        for hf_piece, ours in self.name_renames:
            name = name.replace(hf_piece, ours)
        m = _EXPERT_RE.match(name)
        if m and m.group(3) in self.expert_weight_names:
            shard = self.expert_weight_names[m.group(3)]
            pname = f"{m.group(1)}.{'w2' if shard == 'w2' else 'w13'}_{m.group(4)}"
            return pname, (int(m.group(2)), shard)
        for ours, hf_piece, shard in self.stacked_params_mapping:
            if hf_piece in name:
                return name.replace(hf_piece, ours), shard
        return name, None

    def hf_weight_name(self, pname: str, shard: Any) -> str:
        """Best-effort inverse of :meth:`map_weight_name`, for error messages."""
        name = pname
        if isinstance(shard, tuple):
            inv = {v: k for k, v in self.expert_weight_names.items()}
            name = re.sub(r"\.(w13|w2)_(weight|weight_scale|weight_scale_inv|input_scale)$",
                          lambda m: f".{shard[0]}.{inv.get(shard[1], shard[1])}.{m.group(2)}", pname)
        elif shard is not None:
            for ours, hf_piece, sid in self.stacked_params_mapping:
                if sid == shard and ours in pname:
                    name = pname.replace(ours, hf_piece)
                    break
        for hf_piece, ours in self.name_renames:
            name = name.replace(ours, hf_piece)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     weight_filter: Optional[Callable[[str], bool]] = None) -> None:
        """Copy HF-named tensors into the model (q/k/v -> qkv_proj, gate/up -> gate_up_proj, experts -> FusedMoE).

        ``rotary_emb.inv_freq`` is ignored, and so is ``lm_head.weight`` when embeddings are tied.
        ``weight_filter``: HF names this worker loads (a role's part); parameters whose HF name it rejects
        are not reported missing.
        Raises:
            ValueError: names of tensors the model has no parameter for
                (unexpected), of parameters no tensor filled (missing), or a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            target = self.map_weight_name(hf_name)
            if target is None:
                continue
            pname, shard = target
            param = params.get(pname)
            if param is None:
                unexpected.append(hf_name)
                continue
            loader = getattr(param, "weight_loader", None)
            if isinstance(shard, tuple):
                loader(param, tensor, shard[1], shard[0])
            elif loader is not None:
                loader(param, tensor, shard)
            else:
                _copy_plain(param, materialize(tensor), hf_name)
            loaded.add((pname, shard))
        if unexpected:
            raise ValueError(f"{type(self).__name__}: unexpected tensors in checkpoint: {sorted(unexpected)[:20]}"
                             f"{' ...' if len(unexpected) > 20 else ''}")
        expected = {(n, s) for n, p in params.items() for s in getattr(p, "expected_shards", (None,))}
        missing = sorted(name for name in (self.hf_weight_name(n, s) for n, s in expected - loaded)
                         if weight_filter is None or weight_filter(name))
        if missing:
            raise ValueError(f"{type(self).__name__}: missing tensors in checkpoint ({len(missing)}): "
                             f"{missing[:20]}{' ...' if len(missing) > 20 else ''}")


def _copy_plain(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name}: shape {tuple(tensor.shape)} does not match parameter {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


EntryClass = LlamaForCausalLM
