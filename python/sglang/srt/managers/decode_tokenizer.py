"""The decode half of the server's tokenizer, loadable without transformers or torch (the detokenizer process).

The detokenizer only turns token ids into text. With a HF fast tokenizer whose class keeps the library's own decode
(``TokenizersBackend``: ``decode`` -> ``_decode`` -> the Rust backend's ``decode`` plus an optional clean-up pass),
that text is a function of three things: the backend tokenizer's state, the special-token ids and the clean-up
switch. :meth:`DecodeTokenizerSpec.from_hf` takes them from the HF tokenizer the server process has loaded anyway
(the backend serialised with ``Tokenizer.to_str()``, so nothing is re-derived from the files); the detokenizer
rebuilds the backend with ``tokenizers.Tokenizer.from_str`` and decodes with it. That process then imports neither
transformers nor torch: about 3 CPU-seconds and a few hundred MB less per server start.

Any tokenizer that does not fit (a class that overrides decoding, a slow/sentencepiece tokenizer, an active
clean-up pass, remote code) gets no spec, and the detokenizer loads the HF tokenizer itself as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

#: ``PreTrainedTokenizerBase``/``TokenizersBackend`` methods whose library versions the spec reproduces; a class
#: that overrides any of them decodes differently and gets no spec.
_DECODE_METHODS = ("decode", "_decode", "convert_ids_to_tokens")


@dataclass(frozen=True)
class DecodeTokenizerSpec:
    """What decoding needs of a HF fast tokenizer, picklable and loadable with the ``tokenizers`` package alone.

    Attributes:
        backend_json: the backend tokenizer serialised by ``tokenizers.Tokenizer.to_str()`` (vocabulary, added
            tokens with their ``special`` flags, decoder): decoding with ``skip_special_tokens`` skips exactly the
            added tokens flagged special there, as the HF tokenizer does.
        special_ids: the HF tokenizer's ``all_special_ids``, in its order.
    """

    backend_json: str
    special_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, tokenizer: Any) -> Optional["DecodeTokenizerSpec"]:
        """The spec of a loaded HF tokenizer, or None when its decoding is not the library's fast-tokenizer decode
        (no ``backend_tokenizer``; a class overriding ``decode``/``_decode``/``convert_ids_to_tokens``; a
        clean-up pass that would run, i.e. ``clean_up_tokenization_spaces`` on a non-BPE model or forced on BPE).
        Never raises for an unfit tokenizer: None means "load the HF tokenizer in the detokenizer"."""
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:
            return None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(tokenizer, TokenizersBackend) or backend is None:
            return None
        if any(getattr(type(tokenizer), m, None) is not getattr(TokenizersBackend, m) for m in _DECODE_METHODS):
            return None
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            bpe = type(backend.model).__name__ == "BPE"
            forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                             False)
            if not bpe or forced:
                return None  # the library's clean-up pass would change the text
        return cls(backend_json=backend.to_str(), special_ids=tuple(int(i) for i in tokenizer.all_special_ids))

    def load(self) -> "DecodeTokenizer":
        """Rebuild the backend (imports ``tokenizers`` only).

        Raises:
            ValueError: ``backend_json`` is not a tokenizer the installed ``tokenizers`` can read.
        """
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_str(self.backend_json)
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"cannot rebuild the decode tokenizer ({type(e).__name__}: {e}); start the server "
                             "with the same `tokenizers` version in every process") from e
        return DecodeTokenizer(backend, self.special_ids)


class DecodeTokenizer:
    """The decoding methods the detokenizer calls, with the HF tokenizer's results for the same ids.

    Args:
        backend: a ``tokenizers.Tokenizer``.
        special_ids: the HF tokenizer's ``all_special_ids``.
    """

    def __init__(self, backend: Any, special_ids: Sequence[int]) -> None:
        self._backend = backend
        self.all_special_ids = list(special_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ``ids`` (python ints). ``spaces_between_special_tokens`` is accepted and, as with HF fast
        tokenizers, has no effect."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_id: int) -> Optional[str]:
        """The vocabulary piece of one id (None for an id outside the vocabulary)."""
        return self._backend.id_to_token(int(token_id))
