"""The server's tokenizer for the worker processes, rebuilt from its serialised Rust backend without transformers.

The detokenizer only turns token ids into text, and a scheduler only decodes output tails (stop strings) and
counts the tokens of stop strings. With a HF fast tokenizer whose class keeps the library's own methods
(``TokenizersBackend``: ``decode`` -> ``_decode`` -> the backend's ``decode`` plus an optional clean-up pass;
``encode`` -> the backend's ``encode``), those results are a function of the backend tokenizer's state and the
special-token ids. :meth:`BackendTokenizerSpec.from_hf` takes them from the HF tokenizer the server process loads
anyway (the backend serialised with ``Tokenizer.to_str()``, so nothing is re-derived from the files); a worker
rebuilds it with ``tokenizers.Tokenizer.from_str``. The detokenizer then imports neither transformers nor torch,
and a scheduler skips transformers' import and the tokenizer load (together about 2-3 CPU-seconds per process).
Grammars need the full HF tokenizer (xgrammar reads its vocabulary metadata): :meth:`BackendTokenizer.hf_tokenizer`
loads it on first use.

Any tokenizer that does not fit (a class that overrides encoding or decoding, a slow/sentencepiece tokenizer, an
active clean-up pass) gets no spec, and the workers load the HF tokenizer themselves as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

#: ``PreTrainedTokenizerBase``/``TokenizersBackend`` methods whose library versions this module reproduces; a class
#: that overrides any of them tokenizes differently and gets no spec.
_LIBRARY_METHODS = ("decode", "_decode", "convert_ids_to_tokens", "encode", "_encode_plus", "tokenize")


@dataclass(frozen=True)
class BackendTokenizerSpec:
    """What encoding and decoding need of a HF fast tokenizer, picklable, loadable with ``tokenizers`` alone.

    Attributes:
        backend_json: the backend tokenizer serialised by ``tokenizers.Tokenizer.to_str()`` (vocabulary, added
            tokens with their ``special`` flags, normalizer, pre-tokenizer, decoder): ``skip_special_tokens`` skips
            exactly the added tokens flagged special there, as the HF tokenizer does.
        special_ids: the HF tokenizer's ``all_special_ids``, in its order.
        path: the tokenizer folder (``--tokenizer-path`` resolved), for :meth:`BackendTokenizer.hf_tokenizer`.
        trust_remote_code: as given to the server.
    """

    backend_json: str
    special_ids: tuple[int, ...]
    path: str = ""
    trust_remote_code: bool = False

    @classmethod
    def from_hf(cls, tokenizer: Any, path: str = "", trust_remote_code: bool = False
                ) -> Optional["BackendTokenizerSpec"]:
        """The spec of a loaded HF tokenizer, or None when its tokenization is not the library's fast-tokenizer
        code (no ``backend_tokenizer``; a class overriding ``decode``/``_decode``/``convert_ids_to_tokens``/
        ``encode``/``_encode_plus``/``tokenize``; ``split_special_tokens``; a clean-up pass that would run, i.e.
        ``clean_up_tokenization_spaces`` on a non-BPE model or forced on BPE). Never raises for an unfit tokenizer:
        None means "load the HF tokenizer in the worker"."""
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:
            return None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(tokenizer, TokenizersBackend) or backend is None:
            return None
        if any(getattr(type(tokenizer), m, None) is not getattr(TokenizersBackend, m, None) for m in _LIBRARY_METHODS):
            return None
        if getattr(tokenizer, "split_special_tokens", False):
            return None
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            bpe = type(backend.model).__name__ == "BPE"
            forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                             False)
            if not bpe or forced:
                return None  # the library's clean-up pass would change the text
        return cls(backend_json=backend.to_str(), special_ids=tuple(int(i) for i in tokenizer.all_special_ids),
                   path=str(path), trust_remote_code=bool(trust_remote_code))

    def load(self) -> "BackendTokenizer":
        """Rebuild the backend (imports ``tokenizers`` only).

        Raises:
            ValueError: ``backend_json`` is not a tokenizer the installed ``tokenizers`` can read.
        """
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_str(self.backend_json)
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"cannot rebuild the server's tokenizer from its backend ({type(e).__name__}: {e}); "
                             "run every server process with the same `tokenizers` version") from e
        return BackendTokenizer(backend, self.special_ids, self.path, self.trust_remote_code)


class BackendTokenizer:
    """The tokenizer methods the detokenizer and the schedulers call, with the HF tokenizer's results.

    Args:
        backend: a ``tokenizers.Tokenizer``.
        special_ids: the HF tokenizer's ``all_special_ids``.
        path / trust_remote_code: where :meth:`hf_tokenizer` loads the full tokenizer from.
    """

    def __init__(self, backend: Any, special_ids: Sequence[int], path: str = "", trust_remote_code: bool = False):
        self._backend = backend
        self.all_special_ids = list(special_ids)
        self._path, self._trust_remote_code = path, trust_remote_code
        self._hf: Any = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ``ids`` (python ints). ``spaces_between_special_tokens`` is accepted and, as with HF fast
        tokenizers, has no effect."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (HF's ``encode`` of one string, no truncation or padding)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def convert_ids_to_tokens(self, token_id: int) -> Optional[str]:
        """The vocabulary piece of one id (None for an id outside the vocabulary)."""
        return self._backend.id_to_token(int(token_id))

    def hf_tokenizer(self) -> Any:
        """The full HF tokenizer of the same folder, loaded on first call (grammars need it).

        Raises:
            ValueError: the spec carried no path, or the folder holds no loadable tokenizer.
        """
        if self._hf is None:
            if not self._path:
                raise ValueError("this tokenizer was rebuilt without its folder; pass the HF tokenizer instead")
            from sglang.srt.utils.common import get_tokenizer

            self._hf = get_tokenizer(self._path, self._trust_remote_code)
        return self._hf


def as_hf_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` itself, or for a :class:`BackendTokenizer` the full HF tokenizer it stands for (loaded on first
    call). Raises ValueError as :meth:`BackendTokenizer.hf_tokenizer`."""
    return tokenizer.hf_tokenizer() if isinstance(tokenizer, BackendTokenizer) else tokenizer
