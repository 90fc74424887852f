"""Datasheet GPU specifications for the AFD deployment planner.

The H800 / H20 / L40S rows are Table 3 of MegaScale-Infer (Zhu et al. 2025,
"MegaScale-Infer: Serving Mixture-of-Experts at Scale with Disaggregated Expert
Parallelism", sec. 4.3): memory capacity, memory bandwidth, dense BF16 tensor
throughput and the paper's normalized price per GPU.  H100 and H200 are added
from NVIDIA's SXM datasheets; their prices are *our assumption* in the same
normalized unit (H100 = H800, H200 = 1.15x H100, as on common cloud price lists).

Network and efficiency columns are not in the paper; they are documented
defaults (``docs/afd_plan.md``) that a measured profile (``--profile``) replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind.

    Attributes:
        name: canonical name (``"H20"``).
        memory_gb: device memory, GB (1e9 bytes).
        memory_bw_gbps: HBM/GDDR bandwidth, GB/s (1e9 bytes/s).
        bf16_tflops: dense BF16 tensor-core throughput, TFLOPS (1e12 FLOP/s).
        price_per_hour: price of one GPU per hour, in the paper's normalized
            unit (Table 3); only ratios between plans matter.
        nic_gbps: scale-out network bandwidth per GPU, GB/s (1e9 bytes/s);
            an attention or expert node of ``tp`` GPUs sends/receives at
            ``tp * nic_gbps`` (assumption: one NIC per GPU).
        intra_node_gbps: GPU-to-GPU bandwidth inside a node (NVLink or PCIe),
            GB/s, used for the tensor-parallel all-reduce.
        mem_efficiency: achievable fraction of ``memory_bw_gbps`` (default 0.8).
        compute_efficiency: achievable fraction of ``bf16_tflops`` (default 0.7).
        kernel_overhead_us: fixed per-layer launch/sync cost, microseconds.
        from_paper: True for the Table 3 rows.
    """

    name: str
    memory_gb: float
    memory_bw_gbps: float
    bf16_tflops: float
    price_per_hour: float
    nic_gbps: float
    intra_node_gbps: float
    mem_efficiency: float = 0.8
    compute_efficiency: float = 0.7
    kernel_overhead_us: float = 10.0
    from_paper: bool = False

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes."""
        return self.memory_gb * 1e9

    @property
    def eff_mem_bw(self) -> float:
        """Achievable memory bandwidth, bytes/s."""
        return self.memory_bw_gbps * 1e9 * self.mem_efficiency

    @property
    def eff_flops(self) -> float:
        """Achievable dense BF16 throughput, FLOP/s."""
        return self.bf16_tflops * 1e12 * self.compute_efficiency


# Table 3 of the paper (H800: 3430.4 GB/s = 3.35 TiB/s as the paper lists it).
_SPECS = {
    "H800": GpuSpec("H800", 80, 3430.4, 989, 5.28, nic_gbps=50, intra_node_gbps=200, from_paper=True),
    "H20": GpuSpec("H20", 96, 4096, 148, 1.85, nic_gbps=50, intra_node_gbps=450, from_paper=True),
    "L40S": GpuSpec("L40S", 48, 864, 362, 1.08, nic_gbps=25, intra_node_gbps=32, from_paper=True),
    # Not in the paper: NVIDIA SXM datasheets; prices assumed (see module docstring).
    "H100": GpuSpec("H100", 80, 3350, 989, 5.28, nic_gbps=50, intra_node_gbps=450),
    "H200": GpuSpec("H200", 141, 4800, 989, 6.07, nic_gbps=50, intra_node_gbps=450),
}


def gpu_kinds() -> tuple[str, ...]:
    """Names accepted by :func:`get_gpu_spec` (``--attention-gpu``/``--ffn-gpu``)."""
    return tuple(_SPECS)


def get_gpu_spec(name: str, **overrides) -> GpuSpec:
    """The datasheet spec of GPU kind ``name`` (case-insensitive).

    ``overrides`` replace fields (e.g. ``price_per_hour=2.0``).

    Raises:
        ValueError: unknown kind (the message lists the known ones).
    """
    key = {k.lower(): k for k in _SPECS}.get(str(name).lower())
    if key is None:
        raise ValueError(f"unknown GPU kind {name!r}; choose one of {', '.join(_SPECS)}")
    spec = _SPECS[key]
    return replace(spec, **overrides) if overrides else spec
