"""The NVLink-multicast-off environment, defined once.

NVLS (NVLink SHARP multicast) is forbidden on this project's multi-GPU hosts: every process we start
sets these variables so that NCCL, PyTorch symmetric memory and NVSHMEM never create multicast objects.
Pure Python; importing it touches nothing.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Mapping, MutableMapping, Optional

NVLS_OFF_ENV: Mapping[str, str] = MappingProxyType({
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
})
NVLS_ENV_VARS: tuple[str, ...] = tuple(NVLS_OFF_ENV)


def apply_nvls_off_env(env: Optional[MutableMapping[str, str]] = None) -> MutableMapping[str, str]:
    """Set the multicast-off variables in ``env`` (default ``os.environ``) where they are unset; returns ``env``.

    A value the caller set explicitly is kept (tw-comm's selection still refuses multicast unless every
    variable allows it)."""
    env = os.environ if env is None else env
    for k, v in NVLS_OFF_ENV.items():
        env.setdefault(k, v)
    return env
