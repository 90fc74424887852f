"""Request datasets shared by ``sglang.bench_serving`` and ``sglang.bench_offline_throughput``.

Three datasets, with SGLang's names and semantics:

* ``random``: prompts of random token ids (special tokens excluded) decoded to text, cut so that
  the text re-encodes to at most the drawn length; the reported ``prompt_len`` is the token count
  of that text re-encoded (decode/encode is not an exact round trip, so it can be slightly lower).
* ``random-ids``: the same random token ids, sent as token ids (exact prompt lengths).
* ``sharegpt``: first-turn user prompts of ShareGPT conversations. Output lengths come from the
  reply (second turn) when the file has one, else from ``fixed_output_len``.

Lengths for the random datasets are drawn uniformly from
``[max(1, int(len * range_ratio)), len]`` (SGLang's ``--random-range-ratio``).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

logger = logging.getLogger(__name__)

DATASET_NAMES = ("random", "random-ids", "sharegpt")

DEFAULT_SHAREGPT_OUTPUT_LEN = 256
"""Output length for ShareGPT prompts that have no reply in the file and no ``--sharegpt-output-len``."""


@dataclass(frozen=True)
class DatasetRow:
    """One benchmark request.

    Attributes:
        prompt: text, or a list of token ids (``random-ids``).
        prompt_len: prompt length in tokens of the benchmark tokenizer.
        output_len: number of tokens to generate (``max_new_tokens``).
    """

    prompt: Union[str, list[int]]
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class DatasetConfig:
    """How to sample a dataset (SGLang's bench flags).

    Attributes:
        name: one of :data:`DATASET_NAMES`.
        num_prompts: number of requests to sample (> 0).
        seed: seed of the sampling RNG (same seed, same rows).
        dataset_path: ShareGPT JSON file, or a folder of such files (all ``*.json`` in it).
        random_input_len / random_output_len / random_range_ratio: random datasets' lengths.
        sharegpt_output_len: fixed output length for ShareGPT (None: the reply's length).
        sharegpt_context_len: drop ShareGPT rows whose prompt + output exceed this many tokens
            (None: SGLang's default filter, prompt <= 1024 and prompt + output <= 2048).
    """

    name: str
    num_prompts: int
    seed: int = 1
    dataset_path: str = ""
    random_input_len: int = 1024
    random_output_len: int = 1024
    random_range_ratio: float = 0.0
    sharegpt_output_len: Optional[int] = None
    sharegpt_context_len: Optional[int] = None

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"--dataset-name={self.name!r} is invalid: use one of {', '.join(DATASET_NAMES)}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts={self.num_prompts} is invalid: use a positive integer")
        for flag, v in (("random-input-len", self.random_input_len), ("random-output-len", self.random_output_len)):
            if v < 1:
                raise ValueError(f"--{flag}={v} is invalid: use a positive integer")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise ValueError(f"--random-range-ratio={self.random_range_ratio} is invalid: use a value in [0, 1]")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"--sharegpt-output-len={self.sharegpt_output_len} is invalid: use a positive integer")
        if self.sharegpt_context_len is not None and self.sharegpt_context_len < 2:
            raise ValueError(f"--sharegpt-context-len={self.sharegpt_context_len} is invalid: use an integer >= 2")

    @classmethod
    def from_args(cls, args: Any, name: Optional[str] = None) -> "DatasetConfig":
        """The config of the flags :func:`add_dataset_args` added (``name`` overrides ``--dataset-name``).

        Raises:
            ValueError: a bad flag value (named, see the class).
        """
        return cls(name=name or args.dataset_name, num_prompts=args.num_prompts, seed=args.seed,
                   dataset_path=args.dataset_path, random_input_len=args.random_input_len,
                   random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
                   sharegpt_output_len=args.sharegpt_output_len, sharegpt_context_len=args.sharegpt_context_len)


def add_dataset_args(p: Any, seed_help: str = "Dataset sampling seed.") -> None:
    """Add SGLang's dataset flags (``--dataset-name``, ``--dataset-path``, ``--num-prompts``, ``--sharegpt-*``,
    ``--random-*``, ``--seed``) to the ``argparse`` parser ``p``; :meth:`DatasetConfig.from_args` reads them."""
    p.add_argument("--dataset-name", choices=DATASET_NAMES, default="sharegpt")
    p.add_argument("--dataset-path", default="", help="ShareGPT JSON file or folder of them.")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--sharegpt-context-len", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1, help=seed_help)


def get_dataset(cfg: DatasetConfig, tokenizer: Any) -> list[DatasetRow]:
    """Sample ``cfg.num_prompts`` rows (fewer for ShareGPT if the file has fewer usable rows).

    ``tokenizer`` is a Hugging Face tokenizer (``encode``/``decode``, ``len()`` = vocab size).

    Raises:
        ValueError: bad config, a missing or malformed dataset file, or no usable rows.
    """
    if cfg.name in ("random", "random-ids"):
        return sample_random_requests(cfg, tokenizer, return_ids=cfg.name == "random-ids")
    return sample_sharegpt_requests(cfg, tokenizer)


def _draw_lengths(rng: random.Random, target: int, ratio: float, n: int) -> list[int]:
    lo = max(1, int(target * ratio))
    return [rng.randint(lo, target) for _ in range(n)]


_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def usable_token_ids(tokenizer: Any, for_text: bool = False) -> list[int]:
    """Token ids of ``tokenizer`` that are not special tokens (BOS/EOS/pad/...), ascending.

    With ``for_text``, SentencePiece byte-fallback tokens (``<0xNN>``) are left out too: alone
    they decode to invalid UTF-8 (U+FFFD), which re-encodes to several tokens.

    Raises:
        ValueError: the tokenizer has no non-special tokens.
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special]
    to_tokens = getattr(tokenizer, "convert_ids_to_tokens", None)
    if for_text and to_tokens is not None:
        kept = [i for i, t in zip(ids, to_tokens(ids)) if not (isinstance(t, str) and _BYTE_TOKEN.match(t))]
        ids = kept or ids
    if not ids:
        raise ValueError("the tokenizer has no non-special tokens to build random prompts from")
    return ids


def sample_random_requests(cfg: DatasetConfig, tokenizer: Any, return_ids: bool) -> list[DatasetRow]:
    """``random`` (text) or ``random-ids`` (token ids) rows; see the module docstring."""
    rng = random.Random(cfg.seed)
    vocab = usable_token_ids(tokenizer, for_text=not return_ids)
    in_lens = _draw_lengths(rng, cfg.random_input_len, cfg.random_range_ratio, cfg.num_prompts)
    out_lens = _draw_lengths(rng, cfg.random_output_len, cfg.random_range_ratio, cfg.num_prompts)
    rows = []
    for in_len, out_len in zip(in_lens, out_lens):
        ids = [rng.choice(vocab) for _ in range(in_len)]
        if return_ids:
            rows.append(DatasetRow(prompt=ids, prompt_len=in_len, output_len=out_len))
            continue
        text, n = _text_of_length(tokenizer, ids, in_len)
        rows.append(DatasetRow(prompt=text, prompt_len=n, output_len=out_len))
    return rows


def _text_of_length(tokenizer: Any, ids: list[int], target: int) -> tuple[str, int]:
    """Decode ``ids``; while the text re-encodes to more than ``target`` tokens (adjacent random
    tokens can merge or split differently; cut byte tokens decode to U+FFFD, itself several byte
    tokens), decode a shorter prefix of the re-encoded ids. Returns (text, its token count)."""
    text = tokenizer.decode(ids)
    n = count_tokens(tokenizer, text)
    if n <= target:
        return text, n
    enc = tokenizer.encode(text, add_special_tokens=False, verbose=False)
    cut = target
    for _ in range(16):
        text = tokenizer.decode(enc[:cut])
        n = count_tokens(tokenizer, text)
        if n <= target or cut <= 1:
            break
        cut = max(1, cut - max(1, n - target))
    return text, n


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` without added special tokens."""
    return len(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def load_sharegpt(path: str) -> list[dict]:
    """Conversations of a ShareGPT JSON file, or of every ``*.json`` file in a folder (in name
    order, duplicates by ``id`` dropped).

    Accepts SGLang's format (a list of ``{"conversations": [{"from": "human"|"gpt", "value": ...}]}``)
    and the ``conversation``/``role``/``content`` variant.

    Raises:
        ValueError: the path is missing, holds no JSON files, or a file is not such a list.
    """
    if not path:
        raise ValueError("--dataset-path is empty: the sharegpt dataset needs a ShareGPT JSON file or a folder "
                         "of them (e.g. ../shared/data/datasets/sharegpt/); nothing is downloaded")
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.json")))
        if not files:
            raise ValueError(f"--dataset-path={path!r} is a folder with no *.json files: pass a ShareGPT JSON file")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"--dataset-path={path!r} does not exist: pass a ShareGPT JSON file or folder")
    seen: set = set()
    out: list[dict] = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as e:
                raise ValueError(f"--dataset-path file {f!r} is not valid JSON ({e})") from e
        if not isinstance(data, list):
            raise ValueError(f"--dataset-path file {f!r} is not a JSON list of ShareGPT conversations")
        for item in data:
            key = item.get("id") if isinstance(item, dict) else None
            if key is not None and key in seen:
                continue
            if key is not None:
                seen.add(key)
            out.append(item)
    return out


def _turns(item: Any) -> list[str]:
    if not isinstance(item, dict):
        return []
    conv = item.get("conversations", item.get("conversation"))
    if not isinstance(conv, list):
        return []
    texts = []
    for turn in conv:
        if isinstance(turn, dict):
            v = turn.get("value", turn.get("content"))
            texts.append(v if isinstance(v, str) else "")
    return texts


def sample_sharegpt_requests(cfg: DatasetConfig, tokenizer: Any) -> list[DatasetRow]:
    """ShareGPT rows: shuffled with ``cfg.seed``, rows with prompt or output shorter than 2 tokens
    or over the context filter dropped, the first ``cfg.num_prompts`` kept.

    Raises:
        ValueError: no usable rows (the message says which filter to relax).
    """
    convs = [t for t in (_turns(it) for it in load_sharegpt(cfg.dataset_path)) if t and t[0].strip()]
    random.Random(cfg.seed).shuffle(convs)
    rows: list[DatasetRow] = []
    for turns in convs:
        if len(rows) >= cfg.num_prompts:
            break
        prompt = turns[0]
        prompt_len = count_tokens(tokenizer, prompt)
        if cfg.sharegpt_output_len is not None:
            out_len = cfg.sharegpt_output_len
        elif len(turns) > 1 and turns[1]:
            out_len = count_tokens(tokenizer, turns[1])
        else:
            out_len = DEFAULT_SHAREGPT_OUTPUT_LEN
        if prompt_len < 2 or out_len < 2:
            continue
        if cfg.sharegpt_context_len is not None:
            if prompt_len + out_len > cfg.sharegpt_context_len:
                continue
        elif prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        rows.append(DatasetRow(prompt=prompt, prompt_len=prompt_len, output_len=out_len))
    if not rows:
        raise ValueError(f"no usable ShareGPT rows in {cfg.dataset_path!r}: raise --sharegpt-context-len "
                         "or lower --sharegpt-output-len")
    if len(rows) < cfg.num_prompts:
        logger.warning("only %d ShareGPT rows pass the filters (asked for %d)", len(rows), cfg.num_prompts)
    return rows


def total_prompt_tokens(rows: Sequence[DatasetRow]) -> int:
    """Sum of ``prompt_len`` over ``rows``."""
    return sum(r.prompt_len for r in rows)
