"""Linear layers with Megatron-style tensor-parallel sharding.

Reference: Shoeybi et al., "Megatron-LM" (2019), sec. 3: the first GEMM of a
block is split by output columns (:class:`ColumnParallelLinear`,
:class:`MergedColumnParallelLinear`, :class:`QKVParallelLinear`), the second
by input rows (:class:`RowParallelLinear`), whose partial sums are all-reduced.

Every layer takes ``tp_rank``/``tp_size`` and holds only its rank's shard.
Each parameter carries:
    ``param.weight_loader(param, loaded_full_weight, shard_id=None)``: copy the
        full (unsharded) HF tensor's slice for this rank into ``param``;
    ``param.expected_shards``: the ``shard_id`` values a complete load passes
        (``(None,)`` for unpacked parameters), so model loaders can report
        missing tensors.
Weights are ``[out_local, in_local]`` in ``params_dtype`` on the current
default device (build under ``with torch.device(...)``); ``forward`` is
``F.linear`` (x ``[..., in]`` -> ``[..., out]``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers import ops

logger = logging.getLogger(__name__)
SKINNY_GEMM_ENV = "SGLANG_SKINNY_GEMM"


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``; raises ValueError naming ``what`` when it does not divide evenly."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}; pick a tp_size that divides it")
    return numerator // denominator


def check_tp(tp_rank: int, tp_size: int) -> None:
    """Raise ValueError unless ``0 <= tp_rank < tp_size``."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"invalid tensor parallel rank/size: tp_rank={tp_rank}, tp_size={tp_size}")


def materialize(loaded: Any) -> torch.Tensor:
    """A real tensor from ``loaded``: a tensor as is, or a lazy checkpoint tensor read in full.

    Lazy tensors (e.g. :class:`~sglang.srt.model_loader.loader.SafetensorsSlice`) have ``shape``,
    ``dim()``, ``narrow(dim, start, length) -> Tensor`` (reads only that slice) and
    ``materialize() -> Tensor``; weight loaders narrow them first so a TP rank reads only its shard.
    """
    return loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()


def copy_checked(param: torch.Tensor, loaded: Any, what: str) -> None:
    """``param.copy_(loaded)`` (casting dtype/device) after checking shapes; raises ValueError on mismatch.

    ``loaded`` may be a lazy checkpoint tensor (see :func:`materialize`).
    """
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: loaded shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(materialize(loaded))


def narrow_full(loaded: Any, dim: int, start: int, length: int, full: int, what: str) -> torch.Tensor:
    """``loaded.narrow(dim, start, length)`` after checking that ``loaded.shape[dim] == full`` (the unsharded size).

    ``loaded`` may be lazy (see :func:`materialize`): then only the slice is read.
    Raises ValueError naming ``what`` and the shapes when the loaded tensor has the wrong size.
    """
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise ValueError(f"{what}: loaded shape {tuple(loaded.shape)} has no dim {dim} of size {full}")
    return loaded.narrow(dim, start, length)


def _new_param(shape: Sequence[int], dtype: Optional[torch.dtype], loader, shards: tuple) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    p.expected_shards = shards
    return p


class LinearBase(nn.Module):
    """Common part: a ``[out_local, in_local]`` weight, an optional ``[out_local]`` bias, ``F.linear`` forward."""

    def __init__(self, in_local: int, out_local: int, bias: bool, params_dtype: Optional[torch.dtype],
                 tp_rank: int, tp_size: int, shards: tuple = (None,), bias_shape: Optional[int] = None):
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_local, self.out_local = in_local, out_local
        self.weight = _new_param((out_local, in_local), params_dtype, self.weight_loader, shards)
        # experimental (issue 19): decode batches of <= 16 rows through the skinny Triton GEMM; off by default,
        # read once here (SGLANG_SKINNY_GEMM=1), see sglang.srt.layers.ops.linear
        self.skinny_gemm = os.environ.get(SKINNY_GEMM_ENV, "0") not in ("", "0")
        # issue 27: the DecodeGemmTable the CUDA-graph runner measured on this device (decode_gemm.install), or None
        self.decode_gemm: Optional[Any] = None
        # the SequenceParallelLayout a sequence-parallel executor installed (once); it is active only during its
        # forwards (see forward); None: never sequence-parallel
        self.sequence_parallel: Optional[Any] = None
        if bias:
            self.bias = _new_param((bias_shape or out_local,), params_dtype, self.weight_loader, shards)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_full_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Per-parameter loader hook (see the module docstring); subclasses implement it, the base raises
        NotImplementedError."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: x ``[..., in_local]`` -> ``[..., out_local]`` (weight's dtype/device).

        While the installed ``self.sequence_parallel`` layout (a
        :class:`~sglang.srt.distributed.sequence_parallel.SequenceParallelLayout`, installed by a sequence-parallel
        executor on column-parallel layers) is active, x is this rank's token shard and the result is
        :meth:`forward_gathered`."""
        sp = self.sequence_parallel
        if sp is not None and sp.rows is not None:
            return self.forward_gathered(x, sp.rows, sp.ops)
        if self.skinny_gemm or self.decode_gemm is not None:
            return ops.linear(x, self.weight, self.bias, skinny=self.skinny_gemm, table=self.decode_gemm)
        return F.linear(x, self.weight, self.bias)

    def forward_gathered(self, x_shard: torch.Tensor, rows, sp_ops: Any) -> torch.Tensor:
        """Sequence-parallel input (column-parallel layers): ``F.linear(all_gather(x_shard))``.

        x_shard ``[rows[tp_rank], in]`` (this rank's tokens of a token-sharded activation) -> ``[sum(rows),
        out_local]``. ``sp_ops``: a :class:`~sglang.srt.distributed.sequence_parallel.SequenceParallelOps` (torch
        collective + GEMM, or the fused Triton-distributed AG-GEMM with ``--enable-tdist-overlap``).
        """
        return sp_ops.ag_linear(x_shard, self.weight, self.bias, rows)

    def extra_repr(self) -> str:
        """Local in/out sizes, bias presence and the TP rank/size for ``repr``."""
        return f"in={self.in_local}, out={self.out_local}, bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}"


class ReplicatedLinear(LinearBase):
    """Unsharded linear (every rank holds the full ``[output_size, input_size]`` weight), e.g. MoE routers."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(input_size, output_size, bias, params_dtype, tp_rank, tp_size)

    def weight_loader(self, param, loaded_full_weight, shard_id=None):
        """Copy the full tensor as is (no sharding); ValueError on a shape mismatch."""
        copy_checked(param, loaded_full_weight, type(self).__name__)


class ColumnParallelLinear(LinearBase):
    """Output dim split over ranks: rank r holds rows ``[r*out/tp, (r+1)*out/tp)`` of the HF weight (and bias).

    Raises ValueError when ``output_size % tp_size != 0``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(input_size, divide(output_size, tp_size, "output_size"), bias, params_dtype, tp_rank, tp_size)

    def weight_loader(self, param, loaded_full_weight, shard_id=None):
        """Copy this rank's block of output rows (dim 0) of the full tensor; ValueError on a shape mismatch."""
        n = param.shape[0]
        what = type(self).__name__
        copy_checked(param, narrow_full(loaded_full_weight, 0, self.tp_rank * n, n, n * self.tp_size, what), what)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs packed in one GEMM (e.g. MLP gate and up: ``output_sizes=[I, I]``).

    The local weight is ``[sum(output_sizes)/tp, in]``: this rank's slice of
    output 0, then its slice of output 1, ... ``shard_id`` is the output's
    index; ``shard_id=None`` loads an already packed full weight.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, tp_rank: int = 0, tp_size: int = 1):
        self.output_sizes = list(output_sizes)
        local = [divide(s, tp_size, f"output_sizes[{i}]") for i, s in enumerate(self.output_sizes)]
        self.local_offsets = [sum(local[:i]) for i in range(len(local))]
        self.local_sizes = local
        super().__init__(input_size, sum(local), bias, params_dtype, tp_rank, tp_size,
                         shards=tuple(range(len(local))))

    def weight_loader(self, param, loaded_full_weight, shard_id=None):
        """Copy this rank's rows of sub-matrix ``shard_id`` (int index into ``output_sizes``), or of every sub-matrix of
        a packed tensor when ``shard_id`` is None. Raises ValueError on a bad shard_id or shape."""
        if shard_id is None:
            loaded_full_weight = materialize(loaded_full_weight)
            if loaded_full_weight.shape[0] != sum(self.output_sizes):
                raise ValueError(f"MergedColumnParallelLinear: packed weight has {loaded_full_weight.shape[0]} rows, "
                                 f"expected {sum(self.output_sizes)}")
            for i, part in enumerate(torch.split(loaded_full_weight, self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"MergedColumnParallelLinear: shard_id={shard_id!r} must be in 0..{len(self.local_sizes) - 1}")
        n, off = self.local_sizes[shard_id], self.local_offsets[shard_id]
        what = f"MergedColumnParallelLinear shard {shard_id}"
        copy_checked(param.narrow(0, off, n),
                     narrow_full(loaded_full_weight, 0, self.tp_rank * n, n, self.output_sizes[shard_id], what), what)


class QKVParallelLinear(LinearBase):
    """Packed q, k, v projections, split by heads over ranks.

    Local layout: ``[q_heads_local*head_size + 2*kv_heads_local*head_size, hidden]`` = this rank's q
    heads, then its k heads, then its v heads; ``shard_id`` is "q", "k" or "v"
    (None: an already packed full ``[q; k; v]`` weight).
    Query heads: ``total_num_heads / tp_size`` per rank. KV heads: when
    ``tp_size <= total_num_kv_heads`` each rank holds ``total_num_kv_heads / tp_size``
    of them; when ``tp_size > total_num_kv_heads`` each KV head is *replicated*
    on ``tp_size / total_num_kv_heads`` consecutive ranks (rank r holds KV head
    ``r // (tp_size / total_num_kv_heads)``), so every rank holds exactly one.
    Raises ValueError for counts that do not divide.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: Optional[int] = None, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, tp_rank: int = 0, tp_size: int = 1):
        check_tp(tp_rank, tp_size)
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "tp_size / num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // self.num_kv_head_replicas
        else:
            self.num_kv_head_replicas = 1
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, params_dtype, tp_rank, tp_size,
                         shards=("q", "k", "v"))

    def weight_loader(self, param, loaded_full_weight, shard_id=None):
        """Copy this rank's heads of shard ``'q'``, ``'k'`` or ``'v'`` (or all three from a packed ``[q; k; v]`` tensor
        when ``shard_id`` is None) into the fused weight/bias. Raises ValueError on a bad shard_id or shape."""
        hs = self.head_size
        if shard_id is None:
            loaded_full_weight = materialize(loaded_full_weight)
            sizes = [self.total_num_heads * hs, self.total_num_kv_heads * hs, self.total_num_kv_heads * hs]
            if loaded_full_weight.shape[0] != sum(sizes):
                raise ValueError(f"QKVParallelLinear: packed weight has {loaded_full_weight.shape[0]} rows, expected {sum(sizes)}")
            for sid, part in zip("qkv", torch.split(loaded_full_weight, sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            off, n, start, full = 0, self.q_size, self.tp_rank * self.q_size, self.total_num_heads * hs
        elif shard_id in ("k", "v"):
            off = self.q_size + (0 if shard_id == "k" else self.kv_size)
            n, start, full = self.kv_size, self.kv_head_start * hs, self.total_num_kv_heads * hs
        else:
            raise ValueError(f"QKVParallelLinear: shard_id={shard_id!r} must be 'q', 'k' or 'v'")
        what = f"QKVParallelLinear shard {shard_id}"
        copy_checked(param.narrow(0, off, n), narrow_full(loaded_full_weight, 0, start, n, full, what), what)


class RowParallelLinear(LinearBase):
    """Input dim split over ranks; partial outputs are summed with ``comm.all_reduce``.

    Args:
        input_size, output_size: full (unsharded) sizes; rank r holds columns
            ``[r*in/tp, (r+1)*in/tp)`` of the HF weight, x is ``[..., in/tp]``.
        bias: full ``[output_size]`` bias, added once (on rank 0 before the reduction).
        reduce_results: all-reduce the output (False when the caller fuses the
            reduction, e.g. into AllReduce + residual + RMSNorm: the output is then this
            rank's partial sum, and an :class:`~sglang.srt.layers.layernorm.RMSNorm` built
            with ``comm`` reduces it in ``comm.all_reduce_add_rmsnorm``).
        comm: object with ``all_reduce(t: Tensor) -> Tensor`` (sum over the TP
            group); required when ``tp_size > 1`` and ``reduce_results``.
    Raises ValueError (at forward) when a reduction is needed and ``comm`` is None.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True, comm: Any = None):
        super().__init__(divide(input_size, tp_size, "input_size"), output_size, bias, params_dtype, tp_rank, tp_size)
        self.reduce_results = reduce_results
        self.comm = comm
        # issue 27 (SGLANG_DECODE_FUSE_EPILOGUE): set by sglang.srt.layers.decode_fuse.mark_model where the output
        # feeds a fused add + RMSNorm, which then sums a split-K skinny GEMM's partials itself
        self.defer_splitk_reduce = False

    def weight_loader(self, param, loaded_full_weight, shard_id=None):
        """Copy this rank's block of input columns (dim 1) of the full weight; the 1-D bias is replicated. ValueError on
        a shape mismatch."""
        if param.dim() == 1:  # bias is replicated
            copy_checked(param, loaded_full_weight, "RowParallelLinear bias")
            return
        n = param.shape[1]
        what = "RowParallelLinear"
        copy_checked(param, narrow_full(loaded_full_weight, 1, self.tp_rank * n, n, n * self.tp_size, what), what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., in_local]`` -> ``[..., out]``: the local partial product (bias added on rank 0 only), all-reduced
        over TP when ``reduce_results``. Raises ValueError if tp_size > 1 and no ``comm`` is set. While the installed
        ``self.sequence_parallel`` layout is active: :meth:`forward_scattered` (this rank's token rows). With
        ``defer_splitk_reduce`` (issue 27, one rank) the result may be a
        :class:`~sglang.srt.layers.decode_fuse.SplitKPartials` for the next RMSNorm to reduce."""
        sp = self.sequence_parallel
        if sp is not None and sp.rows is not None:
            return self.forward_scattered(x, sp.rows, sp.ops)
        bias = self.bias if self.tp_rank == 0 else None
        if self.defer_splitk_reduce and self.decode_gemm is not None and self.tp_size == 1:
            return ops.linear_deferred(x, self.weight, bias, self.decode_gemm)  # tensor or SplitKPartials
        if self.skinny_gemm or self.decode_gemm is not None:
            out = ops.linear(x, self.weight, bias, skinny=self.skinny_gemm, table=self.decode_gemm)
        else:
            out = F.linear(x, self.weight, bias)
        if self.tp_size > 1 and self.reduce_results:
            if self.comm is None:
                raise ValueError("RowParallelLinear with tp_size > 1 needs a comm object to all-reduce its output")
            out = self.comm.all_reduce(out)
        return out

    def forward_gathered(self, x_shard, rows, sp_ops):
        """Not defined for a row-parallel layer (its input is already feature-sharded): ValueError."""
        raise ValueError("RowParallelLinear has no gathered form; use forward_scattered (GEMM + ReduceScatter)")

    def forward_scattered(self, x: torch.Tensor, rows, sp_ops: Any) -> torch.Tensor:
        """Sequence-parallel output: this rank's token rows of the summed output, x ``[sum(rows), in_local]`` ->
        ``[rows[tp_rank], out]`` (bias added once). ``sp_ops``: see :meth:`LinearBase.forward_gathered` (the fused
        path is the Triton-distributed GEMM-ReduceScatter)."""
        return sp_ops.linear_rs(x, self.weight, self.bias, rows)
