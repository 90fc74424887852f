"""Per-request sampling parameters, with SGLang's field names and defaults.

A :class:`SamplingParams` is built by the TokenizerManager from the request
JSON (:meth:`SamplingParams.from_dict`), checked (:meth:`verify`), normalized
against the tokenizer (:meth:`normalize`) and shipped to the scheduler inside
``TokenizedGenerateReqInput.sampling_params`` as :meth:`to_dict` output
(msgpack-safe plain types only).
"""

from __future__ import annotations

import logging
import math
import regex
from typing import Any, Optional, Union

logger = logging.getLogger(__name__)

GREEDY_TEMPERATURE_EPS = 1e-6
"""Temperatures below this mean greedy decoding (SGLang's ``_SAMPLING_EPS``)."""

# field -> (kind, default). kind drives the type check in from_dict.
_FIELDS: dict[str, tuple[str, Any]] = {
    "max_new_tokens": ("int?", 128),
    "stop": ("stop", None),
    "stop_token_ids": ("int_list?", None),
    "temperature": ("number", 1.0),
    "top_p": ("number", 1.0),
    "top_k": ("int", -1),
    "min_p": ("number", 0.0),
    "frequency_penalty": ("number", 0.0),
    "presence_penalty": ("number", 0.0),
    "repetition_penalty": ("number", 1.0),
    "min_new_tokens": ("int", 0),
    "ignore_eos": ("bool", False),
    "skip_special_tokens": ("bool", True),
    "spaces_between_special_tokens": ("bool", True),
    "no_stop_trim": ("bool", False),
    "n": ("int", 1),
    "seed": ("int?", None),
    "regex": ("str?", None),
    "json_schema": ("str?", None),
    "ebnf": ("str?", None),
    "stop_regex": ("stop_regex", None),
    "logit_bias": ("logit_bias?", None),
    "custom_params": ("dict?", None),
}
# Derived by normalize(); they travel in to_dict() so the scheduler need not re-tokenize.
_DERIVED: dict[str, tuple[str, Any]] = {
    "stop_strs": ("str_list", None),
    "stop_str_max_len": ("int", 0),
    "stop_regex_strs": ("str_list", None),
    "stop_regex_max_len": ("int", 0),
}

STOP_REGEX_UNBOUNDED = 1 << 30
"""``stop_regex_max_len`` of an unbounded pattern (``\\d+``): the whole output is searched (SGLang's MAX_LEN)."""


def _check_type(name: str, kind: str, value: Any) -> Any:
    """Return ``value`` coerced to ``kind`` or raise ValueError naming ``name``."""
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if value is None and optional:
        return None
    if base == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):  # JSON's NaN / Infinity literals, or 1e400
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return float(value)
    if base == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
        return value
    if base == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean (true/false), got {value!r}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    if base == "int_list":
        if not isinstance(value, (list, tuple)) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value
        ):
            raise ValueError(f"{name} must be a list of integer token ids, got {value!r}")
        return list(value)
    if base == "str_list":
        if not isinstance(value, (list, tuple)) or any(not isinstance(v, str) for v in value):
            raise ValueError(f"{name} must be a list of strings, got {value!r}")
        return list(value)
    if base in ("stop", "stop_regex"):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    if base == "dict":
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a JSON object, got {value!r}")
        return dict(value)
    if base == "logit_bias":
        return parse_logit_bias(value, name)
    raise AssertionError(f"unknown field kind {kind}")


def shown_id(t: int) -> str:
    """A token id for an error message: huge values (``2**70``) in short scientific notation."""
    return str(t) if abs(t) < 10**12 else f"{float(t):g}"


def parse_logit_bias(value: Any, name: str = "logit_bias") -> dict[str, float]:
    """Check a logit bias map ``{token id (str or int): additive bias}`` and return it with string keys
    (JSON object keys are strings; SGLang and OpenAI send ``{"50256": -100}``).

    Raises:
        ValueError: not an object, a key that is not an integer token id, or a non-finite bias (named).
    """
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object mapping token ids to biases, got {value!r}")
    out: dict[str, float] = {}
    for k, v in value.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"{name} keys must be integer token ids, got {k!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}[{k!r}] must be a finite number, got {v!r}")
        out[str(tid)] = float(v)
    return out


def max_regex_chars(pattern: str) -> Optional[int]:
    """Most characters one match of ``pattern`` can span, or None when unbounded (``\\d+``, ``.*``).

    Uses the ``re`` module's own width analysis (``sre_parse`` ``getwidth``); a pattern it cannot
    parse counts as unbounded.
    """
    try:
        from re import _constants as sre_constants, _parser as sre_parse  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_constants
        import sre_parse

    try:
        hi = sre_parse.parse(pattern).getwidth()[1]
    except Exception:  # valid for the regex package but not for re's parser
        return None
    return None if hi >= sre_constants.MAXREPEAT or hi >= (1 << 20) else int(hi)


class SamplingParams:
    """Sampling parameters of one request (mutable; SGLang's fields and defaults).

    Fields:
        max_new_tokens: most tokens to generate; None means "until the context is full".
        stop: stop string(s); generation ends when one appears in the output text.
        stop_token_ids: extra token ids that end generation (besides the model's EOS).
        temperature: softmax temperature; < 1e-6 means greedy (see :meth:`normalize`).
        top_p: nucleus sampling mass in (0, 1]. top_k: keep the k most likely tokens, -1 = off.
        min_p: drop tokens with probability < min_p * max probability (0 = off).
        frequency_penalty / presence_penalty: OpenAI penalties in [-2, 2] on output tokens.
        repetition_penalty: HF/CTRL penalty in (0, 2] on prompt and output tokens (1 = off).
        min_new_tokens: EOS/stop tokens are banned and stop strings ignored until this many tokens exist.
        ignore_eos: do not stop at the model's EOS token.
        skip_special_tokens / spaces_between_special_tokens: detokenization options.
        no_stop_trim: keep the matched stop string / stop token text in the output.
        n: number of completions to sample for the prompt.
        seed: per-request seed; a seeded request samples the same tokens whatever batch it is in.
        regex / json_schema / ebnf: constrained decoding specs (stored only; at most one may be set).
        stop_regex: regular expression(s) (Python ``re`` syntax); generation ends when one matches the
            output text; the match and what follows are trimmed like a stop string, and the finish
            reason's ``matched`` is the pattern.
        logit_bias: ``{token id as str: bias}`` added to the logits before sampling (OpenAI semantics;
            -100 bans a token in practice).
        custom_params: free-form JSON object handed to a custom logit processor (see
            ``--enable-custom-logit-processor``).

    After :meth:`normalize`: ``stop_strs`` (list[str]), ``stop_str_max_len``
    (int, most tokens any stop string takes when tokenized alone), ``stop_regex_strs`` (list[str]) and
    ``stop_regex_max_len`` (int, most characters one match spans; :data:`STOP_REGEX_UNBOUNDED` if unbounded).
    """

    def __init__(
        self,
        max_new_tokens: Optional[int] = 128,
        stop: Optional[Union[str, list[str]]] = None,
        stop_token_ids: Optional[list[int]] = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_new_tokens: int = 0,
        ignore_eos: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        no_stop_trim: bool = False,
        n: int = 1,
        seed: Optional[int] = None,
        regex: Optional[str] = None,
        json_schema: Optional[str] = None,
        ebnf: Optional[str] = None,
        stop_regex: Optional[Union[str, list[str]]] = None,
        logit_bias: Optional[dict[str, float]] = None,
        custom_params: Optional[dict[str, Any]] = None,
    ) -> None:
        self.max_new_tokens = max_new_tokens
        self.stop = stop
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else None
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty
        self.repetition_penalty = repetition_penalty
        self.min_new_tokens = min_new_tokens
        self.ignore_eos = ignore_eos
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.no_stop_trim = no_stop_trim
        self.n = n
        self.seed = seed
        self.regex = regex
        self.json_schema = json_schema
        self.ebnf = ebnf
        self.stop_regex = stop_regex
        self.logit_bias = logit_bias
        self.custom_params = custom_params
        # derived by normalize()
        self.stop_strs: Optional[list[str]] = None
        self.stop_str_max_len: int = 0
        self.stop_regex_strs: Optional[list[str]] = None
        self.stop_regex_max_len: int = 0

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={getattr(self, k)!r}" for k in _FIELDS)
        return f"SamplingParams({inner})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    # ------------------------------------------------------------------ checks
    def verify(self, vocab_size: int) -> None:
        """Check every field's range.

        Args:
            vocab_size: the model's vocabulary size; ``stop_token_ids`` and ``logit_bias`` keys must lie in
                ``[0, vocab_size)`` (an id outside could never match, and would index past the logits).
        Raises:
            ValueError: a field is out of range; the message names the field, the value and the allowed range.
        """
        def bad(msg: str) -> None:
            """Raise ValueError with ``msg``."""
            raise ValueError(msg)

        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            bad(f"max_new_tokens must be >= 0 (or null for 'until the context is full'), got {self.max_new_tokens}")
        for fname in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            v = getattr(self, fname)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(f"{fname} must be a finite number, got {v!r}")
        if self.temperature < 0.0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed < (1 << 63):
            bad(f"seed must be in [0, 2**63 - 1] (or null for no seed), got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            bad(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_new_tokens < 0:
            bad(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad(f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}")
        if self.n < 1:
            bad(f"n must be >= 1, got {self.n}")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                bad(f"stop_token_ids must be token ids in [0, {vocab_size}) (the vocabulary size), "
                    f"got {shown_id(t)}")
        for k in self.logit_bias or {}:
            if not 0 <= int(k) < vocab_size:
                bad(f"logit_bias keys must be token ids in [0, {vocab_size}) (the vocabulary size), "
                    f"got {shown_id(int(k))}")
        regexes = [self.stop_regex] if isinstance(self.stop_regex, str) else (self.stop_regex or [])
        for r in regexes:
            if r == "":
                bad("stop_regex must not contain an empty pattern; remove it")
            try:
                regex.compile(r)
            except (regex.error, RecursionError, OverflowError, ValueError) as e:
                bad(f"stop_regex {r!r} is not a valid regular expression: {e}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        for s in stops:
            if s == "":
                bad("stop must not contain an empty string; remove it")
        n_grammars = sum(x is not None for x in (self.regex, self.json_schema, self.ebnf))
        if n_grammars > 1:
            bad("only one of regex, json_schema and ebnf may be set; drop the others")

    # ---------------------------------------------------------- normalization
    def normalize(self, tokenizer: Any) -> None:
        """Derive ``stop_strs``/``stop_str_max_len`` and fold greedy into ``top_k=1`` (idempotent).

        Args:
            tokenizer: a HF tokenizer (``encode(text, add_special_tokens=False)``), or None when the
                server runs with ``--skip-tokenizer-init``; then ``stop_str_max_len`` is the longest stop
                string's UTF-8 byte length (an upper bound of its token count for byte-level vocabularies).
        """
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)
        max_len = 0
        for s in self.stop_strs:
            if tokenizer is None:
                n_tok = len(s.encode("utf-8"))
            else:
                n_tok = len(tokenizer.encode(s, add_special_tokens=False))
            max_len = max(max_len, n_tok)
        self.stop_str_max_len = max_len
        if self.stop_regex is None:
            self.stop_regex_strs = []
        elif isinstance(self.stop_regex, str):
            self.stop_regex_strs = [self.stop_regex]
        else:
            self.stop_regex_strs = list(self.stop_regex)
        widths = [max_regex_chars(r) for r in self.stop_regex_strs]
        self.stop_regex_max_len = max((STOP_REGEX_UNBOUNDED if w is None else w for w in widths), default=0)
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            # SGLang folds greedy into top-k 1 so one code path handles every row.
            self.temperature = 1.0
            self.top_k = 1

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (after penalties)."""
        return self.top_k == 1 or self.temperature < GREEDY_TEMPERATURE_EPS

    # ------------------------------------------------------------ (de)serial.
    def to_dict(self) -> dict[str, Any]:
        """Plain-type dict (msgpack-safe) of all fields, including the derived ones."""
        d = {k: getattr(self, k) for k in _FIELDS}
        if isinstance(d["stop"], tuple):
            d["stop"] = list(d["stop"])
        d["stop_strs"] = list(self.stop_strs) if self.stop_strs is not None else None
        d["stop_str_max_len"] = self.stop_str_max_len
        d["stop_regex_strs"] = list(self.stop_regex_strs) if self.stop_regex_strs is not None else None
        d["stop_regex_max_len"] = self.stop_regex_max_len
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a request dict (or :meth:`to_dict` output); types are checked, ranges are not.

        A None value for a non-nullable field means "use the default" (OpenAI clients send explicit
        nulls); for nullable ones (max_new_tokens, stop, stop_token_ids, seed, regex, json_schema,
        ebnf) None is kept (``max_new_tokens=None`` = until the context is full).

        Raises:
            ValueError: ``d`` is not a dict, has an unknown key (named), or a value of the wrong type
                (e.g. ``{"temperature": "hot"}`` -> "temperature must be a number, got 'hot'").
        """
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a JSON object, got {type(d).__name__}")
        kwargs: dict[str, Any] = {}
        derived: dict[str, Any] = {}
        for key, value in d.items():
            if key in _FIELDS:
                kind, default = _FIELDS[key]
                if value is None and not kind.endswith("?"):
                    continue  # explicit null for a non-nullable field: keep the default
                kwargs[key] = _check_type(key, kind, value)
            elif key in _DERIVED:
                if value is not None:
                    derived[key] = _check_type(key, _DERIVED[key][0], value)
            else:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; known ones are: {', '.join(_FIELDS)}"
                )
        params = cls(**kwargs)
        if "stop_strs" in derived:
            params.stop_strs = derived["stop_strs"]
        if "stop_str_max_len" in derived:
            params.stop_str_max_len = derived["stop_str_max_len"]
        if "stop_regex_strs" in derived:
            params.stop_regex_strs = derived["stop_regex_strs"]
        if "stop_regex_max_len" in derived:
            params.stop_regex_max_len = derived["stop_regex_max_len"]
        return params
