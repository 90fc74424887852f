"""Small-message all-reduce on GPU through torch symmetric memory (P2P loads/stores over NVLink).

NCCL's ring/tree all-reduce pays several microseconds of protocol latency that dominate decode-size
messages. With every rank's staging buffer mapped into every other rank's address space (CUDA IPC via
``torch.distributed._symmetric_memory``), a reduction is one kernel:

* one-shot: each rank reads all peers' buffers and sums (one barrier; best for the smallest messages);
* two-shot: reduce-scatter by peer loads, then all-gather by peer stores (line-rate traffic).

Only the P2P ops ``symm_mem.one_shot_all_reduce`` and ``symm_mem.two_shot_all_reduce_out`` are called;
never a ``multimem_*`` op: NVLink multicast (NVLS) is forbidden on our hosts and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` keeps torch from creating multicast objects at rendezvous.
Messages above the two-shot limit, odd dtypes or misaligned sizes go to NCCL (:class:`TorchCommunicator`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sglang.srt.distributed.communicator import Communicator, TorchCommunicator

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class CustomAllReduceConfig:
    """Size limits (bytes of the input ``x.numel() * x.element_size()``).

    oneshot_max_bytes: per world size, one-shot up to this many bytes; two_shot_max_bytes: two-shot above
    that and up to this (also the symmetric buffer size per rank); NCCL above.
    """

    oneshot_max_bytes: tuple[tuple[int, int], ...] = ((2, 512 << 10), (4, 256 << 10), (6, 128 << 10),
                                                      (8, 128 << 10))
    two_shot_max_bytes: int = 8 << 20

    def oneshot_limit(self, world: int) -> int:
        """One-shot byte limit for ``world`` ranks (0, i.e. never one-shot, for world sizes not listed)."""
        return dict(self.oneshot_max_bytes).get(world, 0)


def multicast_disabled() -> bool:
    """True when ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` is set to a true-like value."""
    return os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "").strip().lower() in ("1", "true", "yes", "on")


class CustomAllReduceCommunicator(Communicator):
    """All-reduce through symmetric memory for small messages, :class:`TorchCommunicator` otherwise.

    Args:
        ps: the rank's ParallelState (GPU, NCCL device group, world size 2..8).
        config: size limits.
    ``all_gather``/``reduce_scatter`` and large all-reduces delegate to NCCL. Construction is collective:
    it allocates and rendezvouses one ``two_shot_max_bytes`` buffer per rank and checks one-shot and
    two-shot against NCCL on random data; all ranks agree (MIN over the CPU group) on success.
    Raises:
        RuntimeError: symmetric memory is unavailable, the self-check failed on any rank, or
            multicast is not disabled in the environment (the caller falls back to torch).
    """

    name = "custom"

    def __init__(self, ps: Any, config: CustomAllReduceConfig = CustomAllReduceConfig()):
        super().__init__(ps.tp_rank, ps.tp_size)
        self.config = config
        self.fallback = TorchCommunicator(ps.device_group, ps.tp_rank, ps.tp_size)
        self.oneshot_limit = config.oneshot_limit(ps.tp_size)
        self.two_shot_limit = config.two_shot_max_bytes
        ok, why = 1, ""
        try:
            if not multicast_disabled():
                raise RuntimeError("TORCH_SYMM_MEM_DISABLE_MULTICAST is not set to 1 (NVLink multicast is forbidden)")
            self._setup(ps)
            self._self_check()
        except Exception as e:  # any failure: agree with the other ranks, then let the caller fall back
            ok, why = 0, f"{type(e).__name__}: {e}"
        t = torch.tensor([ok], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ps.cpu_group)
        if not int(t.item()):
            raise RuntimeError(f"custom all-reduce unavailable ({why or 'failed on another rank'})")

    def _setup(self, ps: Any) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        group = ps.device_group
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(self.group_name)
            except Exception:  # deprecated / implicit in newer torch
                pass
        self.buffer = symm_mem.empty(self.two_shot_limit, dtype=torch.uint8, device=ps.torch_device())
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.ops = torch.ops.symm_mem

    def _self_check(self) -> None:
        gen = torch.Generator(device=self.buffer.device).manual_seed(1234 + self.rank)
        for numel in (4096, 1 << 20):  # bf16: one-shot (8 KiB) and two-shot (2 MiB) paths
            x = torch.randn(numel, generator=gen, device=self.buffer.device).to(torch.bfloat16)
            ref = self.fallback.all_reduce(x.clone())
            got = self.all_reduce(x.clone())
            err = (got.float() - ref.float()).abs().max().item()
            if not err <= 0.05 * (1 + ref.float().abs().max().item()) or not torch.isfinite(got).all():
                raise RuntimeError(f"self-check failed for {numel} elements: max error {err}")
        torch.cuda.synchronize(self.buffer.device)

    @classmethod
    def create(cls, ps: Any) -> Communicator:
        """This communicator, or :class:`TorchCommunicator` (logged) where it cannot be used."""
        if ps is None or ps.device != "cuda" or ps.tp_size == 1:
            return TorchCommunicator.create(ps)
        try:
            return cls(ps)
        except RuntimeError as e:
            logger.warning("custom all-reduce disabled, using NCCL for everything: %s", e)
            return TorchCommunicator.create(ps)

    def _path(self, x: torch.Tensor) -> str:
        nbytes = x.numel() * x.element_size()
        if x.dtype not in _DTYPES or nbytes % 16 or nbytes > self.two_shot_limit:
            return "nccl"
        return "oneshot" if nbytes <= self.oneshot_limit else "twoshot"

    def all_reduce(self, x):
        """Sum over ranks: staged in the symmetric buffer and reduced one-shot or two-shot by size, or through NCCL for
        large, unaligned or unsupported-dtype inputs. Returns a new tensor of x's shape/dtype."""
        path = self._path(x)
        if path == "nccl":
            return self.fallback.all_reduce(x)
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        staged.copy_(x)
        if path == "oneshot":
            return self.ops.one_shot_all_reduce(staged, "sum", self.group_name)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return self.ops.two_shot_all_reduce_out(staged, "sum", self.group_name, out)

    def all_gather(self, x, dim=-1):
        """Delegates to the NCCL :class:`TorchCommunicator`."""
        return self.fallback.all_gather(x, dim)

    def reduce_scatter(self, x):
        """Delegates to the NCCL :class:`TorchCommunicator`."""
        return self.fallback.reduce_scatter(x)

    def describe(self) -> str:
        """One log line with the one-shot / two-shot byte limits."""
        return (f"CustomAllReduceCommunicator(world_size={self.world_size}, symm-mem P2P one-shot <= "
                f"{self.oneshot_limit} B, two-shot <= {self.two_shot_limit} B, NCCL above; multicast off)")
