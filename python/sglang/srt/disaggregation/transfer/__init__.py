"""KV transfer layer of PD disaggregation (KVDirect, Chen et al. 2024, sec. 4): backends, address plans,
and the pull/push completion protocol. Importing this package never imports nixl."""

from sglang.srt.disaggregation.transfer.base import (MemRegion, ReadOp, TransferBackend, TransferConfig,
                                                     TransferError, TransferHandle, TransferState,
                                                     make_transfer_backend)

__all__ = ["MemRegion", "ReadOp", "TransferBackend", "TransferConfig", "TransferError", "TransferHandle",
           "TransferState", "make_transfer_backend"]
