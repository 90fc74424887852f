"""Custom logit processors sent by clients (SGLang's ``custom_logit_processor`` request field).

SECURITY: a custom logit processor is *client-supplied code*. SGLang's wire format is
``{"callable": <hex of dill.dumps(cls)>}``; deserializing it runs arbitrary Python in the scheduler
process. The server only accepts the field when started with ``--enable-custom-logit-processor``
(off by default; a request carrying it otherwise gets a 400 naming the flag and is never
deserialized), and that flag must only be used when every client is trusted.

The processor protocol (SGLang's ``CustomLogitProcessor``, defined here under SGLang's module path
``sglang.srt.sampling.custom_logit_processor`` so that processors written for SGLang, which dill serializes
with a by-reference link to this base class, load unchanged): the deserialized object is a class (or an
instance); an instance is called as ``processor(logits, custom_param_list)`` with ``logits`` the
``[rows, vocab]`` float32 rows of the requests that named this processor (on the logits' device)
and ``custom_param_list`` one ``custom_params`` dict (or None) per row; it returns the new logits
for those rows (same shape). Serializing and deserializing need the optional ``dill`` package
(``pip install 'sglang[custom-logit-processor]'``); importing this module does not.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

FLAG = "--enable-custom-logit-processor"
MAX_CACHED = 64
"""Deserialized processors kept per process (least recently used dropped first)."""


class CustomLogitProcessor(ABC):
    """Base class of client-defined logit processors (SGLang's API, same module path and wire format).

    Subclass it, implement :meth:`__call__`, and send ``MyProcessor.to_str()`` (or ``MyProcessor().to_str()``)
    as a request's ``custom_logit_processor`` with per-request ``custom_params``; the server must run with
    ``--enable-custom-logit-processor``.
    """

    @abstractmethod
    def __call__(self, logits: torch.Tensor,
                 custom_param_list: Optional[list[Optional[dict[str, Any]]]] = None) -> torch.Tensor:
        """Return new logits for the rows of the requests that use this processor.

        Args:
            logits: [rows, vocab] float32 on the model's device (may be modified in place).
            custom_param_list: per row, the request's ``custom_params`` dict (or None).
        Returns:
            [rows, vocab] tensor (same shape).
        """

    @classmethod
    def to_str(cls) -> str:
        """The wire format: ``'{"callable": "<hex of dill.dumps(cls)>"}'`` (needs ``dill``)."""
        import dill

        return json.dumps({"callable": dill.dumps(cls).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> "CustomLogitProcessor":
        """An instance of the processor class serialized in ``json_str`` (:meth:`to_str`'s format).

        Raises:
            ValueError: ``json_str`` is not ``{"callable": <hex>}`` or does not deserialize to a processor.
        """
        return _load(json_str)


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """Bans ``custom_params["token_ids"]`` (a list of ids, the same for every row using it): logits -inf."""

    def __call__(self, logits: torch.Tensor,
                 custom_param_list: Optional[list[Optional[dict[str, Any]]]] = None) -> torch.Tensor:
        for i, params in enumerate(custom_param_list or []):
            if params and params.get("token_ids"):
                logits[i, list(params["token_ids"])] = float("-inf")
        return logits


def _load(processor_str: str) -> Callable:
    """Deserialize ``processor_str`` (``{"callable": <hex of dill.dumps(obj)>}``); a class is instantiated.

    Raises:
        ValueError: anything fails (names the cause), or the result is not callable.
    """
    import dill

    try:
        obj = dill.loads(bytes.fromhex(json.loads(processor_str)["callable"]))
        fn = obj() if isinstance(obj, type) else obj
    except Exception as e:
        raise ValueError(f"custom_logit_processor could not be loaded: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError("custom_logit_processor did not deserialize to a callable")
    return fn


def check_allowed(value: Any, enabled: bool) -> Optional[str]:
    """Validate a request's ``custom_logit_processor`` field without deserializing it.

    Args:
        value: the field as sent (None or a JSON string).
        enabled: whether the server runs with ``--enable-custom-logit-processor``.
    Returns:
        The string to forward to the scheduler, or None when the field is absent.
    Raises:
        ValueError: the field is set while the flag is off (the message names the flag), or it is not
            a JSON string of an object with a ``callable`` key.
    """
    if value is None:
        return None
    if not enabled:
        raise ValueError(f"custom_logit_processor is disabled on this server; it runs client-supplied code, so "
                         f"the server must be started with {FLAG} (only for trusted clients)")
    if not isinstance(value, str):
        raise ValueError(f"custom_logit_processor must be a string (CustomLogitProcessor.to_str()), got {value!r}")
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"custom_logit_processor is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("callable"), str):
        raise ValueError('custom_logit_processor must be a JSON object {"callable": "<hex>"} '
                         "as made by CustomLogitProcessor.to_str()")
    try:
        import dill  # noqa: F401
    except ImportError:
        raise ValueError("custom_logit_processor needs the dill package on the server "
                         "(pip install 'sglang[custom-logit-processor]')") from None
    return value


class ProcessorCache:
    """Deserializes processor strings (bounded LRU, :data:`MAX_CACHED` entries) and applies them.

    Only the scheduler process uses it, and only for requests that passed :func:`check_allowed`.
    """

    def __init__(self) -> None:
        self._cache: "OrderedDict[str, Callable]" = OrderedDict()

    def get(self, processor_str: str) -> Callable:
        """The processor instance for ``processor_str`` (deserialized once, then cached).

        Raises:
            ValueError: the payload cannot be deserialized or is not callable.
        """
        fn = self._cache.get(processor_str)
        if fn is not None:
            self._cache.move_to_end(processor_str)
            return fn
        fn = _load(processor_str)
        self._cache[processor_str] = fn
        if len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)
        return fn

    def apply(self, logits: torch.Tensor, processors: list[Optional[str]],
              params: list[Optional[dict[str, Any]]]) -> dict[int, str]:
        """Run each distinct processor on its rows of ``logits`` ([bs, vocab] float32, in place).

        Returns:
            ``{row: error message}`` for rows whose processor failed to load, raised, or returned a
            tensor of the wrong shape (their logits are left as they were; the caller aborts them).
        """
        errors: dict[int, str] = {}
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(processors):
            if p is not None:
                groups.setdefault(p, []).append(i)
        for p, rows in groups.items():
            idx = torch.tensor(rows, device=logits.device)
            try:
                fn = self.get(p)
                new = fn(logits[idx].clone(), [params[i] for i in rows])
                if not isinstance(new, torch.Tensor) or tuple(new.shape) != (len(rows), logits.shape[1]):
                    raise ValueError("it must return a tensor shaped like its input logits")
            except Exception as e:  # client code: any failure aborts only its own requests
                msg = str(e) if isinstance(e, ValueError) and str(e).startswith("custom_logit_processor") \
                    else f"custom_logit_processor failed: {type(e).__name__}: {e}"
                logger.warning("%s", msg)
                errors.update({i: msg for i in rows})
                continue
            logits[idx] = new.to(device=logits.device, dtype=logits.dtype)
        return errors
