"""TokenPieces: exact per-token bytes/offsets for OpenAI logprobs, on the real tokenizers in ../shared/data."""

import random

import pytest

from conftest import shared_path

TOKENIZERS = [("models", "stories260K"), ("tokenizers", "llama3"), ("tokenizers", "qwen2")]
ALPHABET = list("abcdefghij klmnop,.!?'\n") + ["é", "ß", "日本", "😀", "👍🏽", "  ", "\t", "ü", "—"]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(5, 40))).lstrip(" ")


@pytest.fixture(scope="module", params=TOKENIZERS, ids=lambda p: p[1])
def pieces(request):
    from transformers import AutoTokenizer

    from sglang.srt.managers.token_pieces import TokenPieces

    return TokenPieces(AutoTokenizer.from_pretrained(shared_path(*request.param)))


def test_bytes_concatenate_to_the_text(pieces):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(30):
        text = _random_text(rng)
        ids = pieces.tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(pieces.bytes_of(t) for t in ids)
        if pieces.strips_leading_space and joined.startswith(b" ") and not text.startswith(" "):
            joined = joined[1:]  # SentencePiece's dummy prefix space
        assert joined == text.encode("utf-8"), (seed, text, pieces.tokenizer.convert_ids_to_tokens(ids))


def test_offsets_index_the_decoded_text(pieces):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    tok = pieces.tokenizer
    for _ in range(30):
        text = _random_text(rng)
        ids = tok.encode(text)  # with BOS where the tokenizer adds one
        decoded = tok.decode(ids, skip_special_tokens=True)
        offs = pieces.offsets(ids, 0, at_sequence_start=True)
        assert len(offs) == len(ids) + 1 and offs[-1] == len(decoded), (seed, text)
        assert offs == sorted(offs)
        for i, t in enumerate(ids):
            piece = pieces.text_of(t)
            if t in pieces.special_ids or "\ufffd" in piece:
                continue
            start = offs[i]
            if i == 0 or all(x in pieces.special_ids for x in ids[:i]):
                piece = piece[1:] if pieces.strips_leading_space and piece.startswith(" ") else piece
            assert decoded[start:start + len(piece)] == piece, (seed, text, i)


def test_leading_space_and_special_tokens(pieces):
    tok = pieces.tokenizer
    ids = tok.encode("Once upon a time there", add_special_tokens=False)
    assert pieces.text_of(ids[-1]) == " there"
    for sid in pieces.special_ids:
        assert pieces.bytes_of(sid) == tok.convert_ids_to_tokens(sid).encode()
