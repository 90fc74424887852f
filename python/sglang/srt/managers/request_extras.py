"""Validation of the optional per-request extras the TokenizerManager forwards to the scheduler.

CPU-only. Kept out of ``tokenizer_manager.py`` so that module stays small.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.sampling.custom_logit_processor import check_allowed
from sglang.srt.sampling.sampling_params import shown_id


def extra_fields(req, vocab_size: int, server_args) -> dict[str, Any]:
    """``token_ids_logprob`` and ``custom_logit_processor`` of one
    :class:`~sglang.srt.managers.generate_req.SingleGenerateReq`, as
    :class:`~sglang.srt.managers.io_struct.TokenizedGenerateReqInput` keyword arguments.

    Args:
        req: the single request.
        vocab_size: the model's vocabulary size (token ids must lie in ``[0, vocab_size)``).
        server_args: reads ``enable_custom_logit_processor``.
    Raises:
        ValueError: a ``token_ids_logprob`` id outside the vocabulary, or a custom logit processor while
            ``--enable-custom-logit-processor`` is off (the message names the flag) or malformed.
    """
    tids = getattr(req, "token_ids_logprob", None)
    for t in tids or []:
        if not 0 <= t < vocab_size:
            raise ValueError(f"token_ids_logprob must lie in [0, {vocab_size}) (the vocabulary size), "
                             f"got {shown_id(t)}")
    proc = check_allowed(getattr(req, "custom_logit_processor", None),
                         bool(getattr(server_args, "enable_custom_logit_processor", False)))
    return {"token_ids_logprob": list(tids) if tids and req.return_logprob else None,
            "custom_logit_processor": proc}
