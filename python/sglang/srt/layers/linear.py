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

Where a checkpoint tensor lands is one :class:`ShardSpec` per ``shard_id`` (:meth:`LinearBase.shard_spec`): the
plain weight loader and the quantization methods (:mod:`sglang.srt.layers.quantization`, which replace a layer's
weight by FP8 weights and scales at load and run its GEMM through ``layer.quant_method.apply``) share it, so the
weights and their scales are sharded by the same rule.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

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


@dataclass(frozen=True)
class ShardSpec:
    """Where one full checkpoint tensor of a projection lands in this rank's local ``[out_local, in_local]`` weight.

    The checkpoint tensor is ``[full_rows, full_cols]`` (output x input features of one HF projection, e.g.
    ``k_proj``); this rank reads its rows ``[src_row, src_row + rows)`` and columns ``[src_col, src_col + cols)``
    and writes them to local rows ``[dst_row, dst_row + rows)`` (all ``cols == in_local`` columns). 1-D tensors of the
    projection (bias, per-output-channel scales) use the row part only. Column-parallel layers narrow rows,
    row-parallel ones columns (Megatron-LM, Shoeybi et al. 2019, sec. 3).
    """

    dst_row: int
    rows: int
    src_row: int
    full_rows: int
    src_col: int
    cols: int
    full_cols: int

    def take_rows(self, loaded: Any, what: str) -> Any:
        """This rank's rows ``[src_row, src_row + rows)`` of ``loaded`` (dim 0 must be ``full_rows``; every column);
        a lazy checkpoint tensor stays lazy when all rows are taken. Raises ValueError on a wrong size."""
        if loaded.dim() < 1 or loaded.shape[0] != self.full_rows:
            raise ValueError(f"{what}: loaded shape {tuple(loaded.shape)} has no dim 0 of size {self.full_rows}")
        if self.src_row == 0 and self.rows == self.full_rows:
            return loaded
        return loaded.narrow(0, self.src_row, self.rows)

    def take_cols(self, loaded: Any, what: str) -> Any:
        """This rank's columns ``[src_col, src_col + cols)`` of a 2-D ``loaded`` (dim 1 must be ``full_cols``)."""
        if loaded.dim() != 2 or loaded.shape[1] != self.full_cols:
            raise ValueError(f"{what}: loaded shape {tuple(loaded.shape)} has no dim 1 of size {self.full_cols}")
        if self.src_col == 0 and self.cols == self.full_cols:
            return loaded
        return loaded.narrow(1, self.src_col, self.cols)

    def take(self, loaded: Any, what: str) -> Any:
        """This rank's ``[rows, cols]`` block of a 2-D ``loaded`` (or its rows of a 1-D one); ValueError on a wrong
        shape. A lazy checkpoint tensor reads only what the rank needs."""
        if loaded.dim() == 1:
            return self.take_rows(loaded, what)
        return self.take_cols(self.take_rows(loaded, what), what)


class LinearBase(nn.Module):
    """Common part: a ``[out_local, in_local]`` weight, an optional ``[out_local]`` bias, ``F.linear`` forward.

    Subclasses define :meth:`shard_spec` (and, for packed layers, :meth:`split_packed`); the weight loader is
    shared. ``quant_method``: the :class:`~sglang.srt.layers.quantization.base.LinearMethodBase` chosen once at load
    (:func:`sglang.srt.layers.quantization.apply_quantization`), which owns the weights and runs the GEMM; None: the
    model-dtype weight above.
    """

    def __init__(self, in_local: int, out_local: int, bias: bool, params_dtype: Optional[torch.dtype],
                 tp_rank: int, tp_size: int, shards: tuple = (None,), bias_shape: Optional[int] = None):
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_local, self.out_local = in_local, out_local
        self.weight = _new_param((out_local, in_local), params_dtype, self.weight_loader, shards)
        # experimental: decode batches of <= 16 rows through the skinny Triton GEMM; off by default,
        # read once here (SGLANG_SKINNY_GEMM=1), see sglang.srt.layers.ops.linear
        self.skinny_gemm = os.environ.get(SKINNY_GEMM_ENV, "0") not in ("", "0")
        # the DecodeGemmTable the CUDA-graph runner measured on this device (decode_gemm.install), or None
        self.decode_gemm: Optional[Any] = None
        # the SequenceParallelLayout a sequence-parallel executor installed (once); it is active only during its
        # forwards (see forward); None: never sequence-parallel
        self.sequence_parallel: Optional[Any] = None
        self.quant_method: Optional[Any] = None  # set once at load by sglang.srt.layers.quantization
        if bias:
            self.bias = _new_param((bias_shape or out_local,), params_dtype, self.weight_loader, shards)
        else:
            self.register_parameter("bias", None)

    def shard_spec(self, shard_id: Any = None) -> ShardSpec:
        """The :class:`ShardSpec` of the checkpoint tensor ``shard_id`` (None for an unpacked layer); subclasses
        implement it (the base raises NotImplementedError). Raises ValueError for an unknown ``shard_id``."""
        raise NotImplementedError

    def split_packed(self, loaded: Any) -> Optional[List[Tuple[Any, torch.Tensor]]]:
        """For packed layers: an already packed full tensor (``shard_id=None``) split into ``(shard_id, part)`` pairs
        along dim 0; None for unpacked layers (the default). Raises ValueError on a wrong row count."""
        return None

    def _name(self, shard_id: Any) -> str:
        return type(self).__name__ if shard_id is None else f"{type(self).__name__} shard {shard_id}"

    def weight_loader(self, param: nn.Parameter, loaded_full_weight: Any, shard_id: Any = None) -> None:
        """Copy this rank's part of one full checkpoint tensor (weight ``[rows, in]`` or 1-D bias) into ``param`` at
        the rows :meth:`shard_spec` gives (a packed tensor with ``shard_id=None`` is split first). A lazy checkpoint
        tensor is read only where this rank needs it. Raises ValueError on a bad shard_id or shape."""
        if shard_id is None:
            parts = self.split_packed(loaded_full_weight)
            if parts is not None:
                for sid, part in parts:
                    self.weight_loader(param, part, sid)
                return
        spec = self.shard_spec(shard_id)
        what = self._name(shard_id)
        src = spec.take(loaded_full_weight, what) if param.dim() == 2 else spec.take_rows(loaded_full_weight, what)
        copy_checked(param.narrow(0, spec.dst_row, spec.rows), src, what)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The local GEMM ``x @ W^T (+ bias)``: the quantization method's when one is set, else the model-dtype
        weight through :func:`sglang.srt.layers.ops.linear` (decode-GEMM table / skinny kernel) or ``F.linear``."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        if self.skinny_gemm or self.decode_gemm is not None:
            return ops.linear(x, self.weight, bias, skinny=self.skinny_gemm, table=self.decode_gemm)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: x ``[..., in_local]`` -> ``[..., out_local]`` (weight's dtype/device).

        While the installed ``self.sequence_parallel`` layout (a
        :class:`~sglang.srt.distributed.sequence_parallel.SequenceParallelLayout`, installed by a sequence-parallel
        executor on column-parallel layers) is active, x is this rank's token shard and the result is
        :meth:`forward_gathered`."""
        sp = self.sequence_parallel
        if sp is not None and sp.rows is not None:
            return self.forward_gathered(x, sp.rows, sp.ops)
        return self._matmul(x, self.bias)

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

    def shard_spec(self, shard_id=None) -> ShardSpec:
        """The whole tensor (no sharding); ValueError for a shard_id other than None."""
        if shard_id is not None:
            raise ValueError(f"ReplicatedLinear: shard_id={shard_id!r} must be None")
        return ShardSpec(0, self.out_local, 0, self.out_local, 0, self.in_local, self.in_local)


class ColumnParallelLinear(LinearBase):
    """Output dim split over ranks: rank r holds rows ``[r*out/tp, (r+1)*out/tp)`` of the HF weight (and bias).

    Raises ValueError when ``output_size % tp_size != 0``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(input_size, divide(output_size, tp_size, "output_size"), bias, params_dtype, tp_rank, tp_size)

    def shard_spec(self, shard_id=None) -> ShardSpec:
        """This rank's block of output rows (dim 0) of the full tensor; ValueError for a shard_id other than None."""
        if shard_id is not None:
            raise ValueError(f"ColumnParallelLinear: shard_id={shard_id!r} must be None")
        n = self.out_local
        return ShardSpec(0, n, self.tp_rank * n, n * self.tp_size, 0, self.in_local, self.in_local)


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

    def split_packed(self, loaded):
        """An already packed full ``[sum(output_sizes), ...]`` tensor split into its ``(index, part)`` sub-matrices."""
        loaded = materialize(loaded)
        if loaded.shape[0] != sum(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear: packed weight has {loaded.shape[0]} rows, "
                             f"expected {sum(self.output_sizes)}")
        return list(enumerate(torch.split(loaded, self.output_sizes, dim=0)))

    def shard_spec(self, shard_id=None) -> ShardSpec:
        """This rank's rows of sub-matrix ``shard_id`` (int index into ``output_sizes``), placed after the local
        slices of the sub-matrices before it. Raises ValueError on a bad shard_id."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"MergedColumnParallelLinear: shard_id={shard_id!r} must be in 0..{len(self.local_sizes) - 1}")
        n, off = self.local_sizes[shard_id], self.local_offsets[shard_id]
        return ShardSpec(off, n, self.tp_rank * n, self.output_sizes[shard_id], 0, self.in_local, self.in_local)


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

    def split_packed(self, loaded):
        """An already packed full ``[q; k; v]`` tensor split into its ``("q" | "k" | "v", part)`` pieces."""
        loaded = materialize(loaded)
        hs = self.head_size
        sizes = [self.total_num_heads * hs, self.total_num_kv_heads * hs, self.total_num_kv_heads * hs]
        if loaded.shape[0] != sum(sizes):
            raise ValueError(f"QKVParallelLinear: packed weight has {loaded.shape[0]} rows, expected {sum(sizes)}")
        return list(zip("qkv", torch.split(loaded, sizes, dim=0)))

    def shard_spec(self, shard_id=None) -> ShardSpec:
        """This rank's heads of shard ``'q'``, ``'k'`` or ``'v'`` in the fused local layout (q, then k, then v; see
        the class docstring for replicated KV heads). Raises ValueError on a bad shard_id."""
        hs = self.head_size
        if shard_id == "q":
            off, n, start, full = 0, self.q_size, self.tp_rank * self.q_size, self.total_num_heads * hs
        elif shard_id in ("k", "v"):
            off = self.q_size + (0 if shard_id == "k" else self.kv_size)
            n, start, full = self.kv_size, self.kv_head_start * hs, self.total_num_kv_heads * hs
        else:
            raise ValueError(f"QKVParallelLinear: shard_id={shard_id!r} must be 'q', 'k' or 'v'")
        return ShardSpec(off, n, start, full, 0, self.in_local, self.in_local)


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
        # epilogue fusion (SGLANG_DECODE_FUSE_EPILOGUE): set by sglang.srt.layers.decode_fuse.mark_model where the
        # output feeds a fused add + RMSNorm, which then sums a split-K skinny GEMM's partials itself
        self.defer_splitk_reduce = False

    def shard_spec(self, shard_id=None) -> ShardSpec:
        """This rank's block of input columns (dim 1) of the full weight, all output rows (so a 1-D bias or
        per-output-channel scale is replicated). ValueError for a shard_id other than None."""
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear: shard_id={shard_id!r} must be None")
        n = self.in_local
        return ShardSpec(0, self.out_local, 0, self.out_local, self.tp_rank * n, n, n * self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., in_local]`` -> ``[..., out]``: the local partial product (bias added on rank 0 only), all-reduced
        over TP when ``reduce_results``. Raises ValueError if tp_size > 1 and no ``comm`` is set. While the installed
        ``self.sequence_parallel`` layout is active: :meth:`forward_scattered` (this rank's token rows). With
        ``defer_splitk_reduce`` (decode epilogue fusion, one rank) the result may be a
        :class:`~sglang.srt.layers.decode_fuse.SplitKPartials` for the next RMSNorm to reduce."""
        sp = self.sequence_parallel
        if sp is not None and sp.rows is not None:
            return self.forward_scattered(x, sp.rows, sp.ops)
        bias = self.bias if self.tp_rank == 0 else None
        if self.defer_splitk_reduce and self.decode_gemm is not None and self.tp_size == 1 \
                and self.quant_method is None:
            return ops.linear_deferred(x, self.weight, bias, self.decode_gemm)  # tensor or SplitKPartials
        out = self._matmul(x, bias)
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
