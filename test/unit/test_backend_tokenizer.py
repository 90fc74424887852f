"""The worker processes' transformers-free tokenizer (``sglang.srt.managers.backend_tokenizer``) against the HF
tokenizer it is taken from, on the real tokenizers in ``../shared/data`` and fresh random ids and texts: same text
with and without special tokens, same ids for stop strings, same pieces, same special ids, same incremental
stream; the HF tokenizer for grammars on demand; unfit tokenizers get no spec; the detokenizer built from a spec
imports neither transformers nor torch; the launcher hands the spec to the detokenizer and every scheduler."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.srt.managers.backend_tokenizer import BackendTokenizer, BackendTokenizerSpec, as_hf_tokenizer
from sglang.srt.managers.detokenizer_manager import IncrementalDetokenizer

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
TOKENIZERS = {"stories260K": DATA / "models" / "stories260K", "llama3": DATA / "tokenizers" / "llama3",
              "qwen2": DATA / "tokenizers" / "qwen2"}
REPO = Path(__file__).resolve().parents[2]


def _hf(name: str):
    path = TOKENIZERS[name]
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"tokenizer not found at {path} (shared test data absent)")
    from sglang.srt.utils.common import get_tokenizer

    return get_tokenizer(str(path))


def _random_ids(rng: random.Random, hf, n: int) -> list[int]:
    """Ids from the whole range (added and special tokens included), biased towards the special ones."""
    top = len(hf) - 1
    special = list(hf.all_special_ids)
    return [rng.choice(special) if special and rng.random() < 0.1 else rng.randint(0, top) for _ in range(n)]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_decode_equals_hf_on_random_ids(name):
    """Decoded text, pieces and special ids equal the HF tokenizer's, for fresh random ids."""
    hf = _hf(name)
    spec = BackendTokenizerSpec.from_hf(hf)
    assert spec is not None, f"{name}: {type(hf).__name__} keeps the library decode, so it should get a spec"
    spec = pickle.loads(pickle.dumps(spec))  # it travels to the detokenizer pickled
    tok = spec.load()
    assert tok.all_special_ids == list(hf.all_special_ids)
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for _ in range(150):
        ids = _random_ids(rng, hf, rng.randint(1, 40))
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
        i = rng.randint(0, len(hf) - 1)
        assert tok.convert_ids_to_tokens(i) == hf.convert_ids_to_tokens(i), i


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_encode_equals_hf_on_random_texts(name):
    """Stop strings are counted in tokens with ``encode(s, add_special_tokens=False)``: the same ids as HF's, for
    random texts mixing words, spaces, punctuation, non-ASCII and the special tokens' own text (and with special
    tokens added)."""
    hf = _hf(name)
    tok = BackendTokenizerSpec.from_hf(hf).load()
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    pieces = ["Once", " upon", " a", " time", "\n", "  ", "!", "?!", ",", "é", "日本", "😀", "\t", "don't", "1234",
              *hf.all_special_tokens]
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for add in (False, True):
            assert tok.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), (text, add)


def test_hf_tokenizer_on_demand_for_grammars():
    """A worker's backend tokenizer hands out the HF tokenizer of its folder (xgrammar needs it), loaded once."""
    hf = _hf("stories260K")
    tok = BackendTokenizerSpec.from_hf(hf, str(TOKENIZERS["stories260K"])).load()
    full = as_hf_tokenizer(tok)
    assert full is as_hf_tokenizer(tok) and full.get_vocab() == hf.get_vocab()
    assert as_hf_tokenizer(hf) is hf
    with pytest.raises(ValueError, match="without its folder"):
        BackendTokenizerSpec.from_hf(hf).load().hf_tokenizer()


@pytest.mark.parametrize("name", ["stories260K", "llama3"])
def test_incremental_stream_equals_hf(name):
    """The detokenizer's incremental deltas (byte-fallback hold-back, special-token skipping) are the same over
    either tokenizer, chunk by chunk."""
    hf = _hf(name)
    tok = BackendTokenizerSpec.from_hf(hf).load()
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for _ in range(30):
        ids = _random_ids(rng, hf, rng.randint(5, 60))
        skip = rng.random() < 0.5
        streams = []
        for t in (hf, tok):
            d, out, pos = IncrementalDetokenizer(t, skip_special_tokens=skip), [], 0
            r = random.Random(len(ids))
            while pos < len(ids):
                k = r.randint(1, 4)
                out.append(d.step(ids[pos:pos + k], None if pos + k < len(ids) else {"type": "length"}))
                pos += k
            streams.append(out)
        assert streams[0] == streams[1], (ids, skip)


def test_unfit_tokenizers_get_no_spec():
    """A class that overrides decoding, an object that is not a fast tokenizer, and a clean-up pass that would run
    all fall back to the HF tokenizer (None)."""
    hf = _hf("stories260K")

    class OwnDecode(type(hf)):
        def _decode(self, token_ids, skip_special_tokens=False, **kw):
            return "x"

    class OwnEncode(type(hf)):
        def encode(self, text, *a, **kw):
            return [0]

    for cls in (OwnDecode, OwnEncode):
        own = cls.from_pretrained(str(TOKENIZERS["stories260K"]), local_files_only=True)
        assert BackendTokenizerSpec.from_hf(own) is None, cls.__name__
    assert BackendTokenizerSpec.from_hf(object()) is None
    forced = _hf("stories260K")
    forced.clean_up_tokenization_spaces = True
    forced.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert BackendTokenizerSpec.from_hf(forced) is None
    forced.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = False
    assert BackendTokenizerSpec.from_hf(forced) is not None  # the library skips clean-up on BPE: same text


def test_bad_backend_json_is_a_value_error():
    with pytest.raises(ValueError, match="cannot rebuild the server's tokenizer"):
        BackendTokenizerSpec(backend_json="{not json", special_ids=()).load()


def test_detokenizer_from_a_spec_imports_neither_transformers_nor_torch(tmp_path):
    """What the spawned detokenizer imports (the launcher's main module, the launcher, the manager) plus the
    rebuilt tokenizer: no transformers, no torch."""
    hf = _hf("stories260K")
    spec_file = tmp_path / "spec.pkl"
    spec_file.write_bytes(pickle.dumps(BackendTokenizerSpec.from_hf(hf)))
    ids = hf.encode("Once upon a time, there was a dog.")
    code = (
        "import pickle, sys\n"
        "import sglang.launch_server, sglang.srt.entrypoints.worker_launcher\n"
        "from sglang.srt.managers.detokenizer_manager import IncrementalDetokenizer\n"
        f"tok = pickle.load(open({str(spec_file)!r}, 'rb')).load()\n"
        f"print(tok.decode({ids!r}, skip_special_tokens=True))\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == hf.decode(ids, skip_special_tokens=True)


def test_launcher_hands_the_spec_to_the_detokenizer_and_every_scheduler(monkeypatch):
    """The launcher loads the front end's tokenizer once, before spawning: the detokenizer's arguments and every
    scheduler's wiring carry its spec (an FFN worker's does not), the TokenizerManager gets the tokenizer; with
    ``--skip-tokenizer-init`` there is neither. Nothing is spawned (a recording launcher)."""
    if not (TOKENIZERS["stories260K"] / "tokenizer.json").exists():
        pytest.skip("shared test data absent")
    from sglang.srt.deployment.compose import plan_deployment
    from sglang.srt.entrypoints import launch
    from sglang.srt.server_args import PortArgs, ServerArgs

    launched = []

    class Recorder:
        pid = 0

        def launch(self, spec):
            launched.append(spec)
            return self

    monkeypatch.setattr(launch, "MultiprocessingLauncher", Recorder)
    for skip in (False, True):
        launched.clear()
        args = ServerArgs(model_path=str(TOKENIZERS["stories260K"]), device="cpu", tp_size=2, skip_tokenizer_init=skip)
        procs, _ = launch._start_local(plan_deployment(args), args, PortArgs.init_new())
        workers, detok = launched[:-1], launched[-1]
        assert [w.args[0].tp_size for w in workers] == [2, 2]
        specs = [w.args[0].wiring.tokenizer for w in workers] + [detok.args[4]]
        if skip:
            assert procs.tokenizer is None and specs == [None] * 3
        else:
            assert procs.tokenizer is not None and specs[0] is not None and all(s == specs[0] for s in specs)
            assert specs[0].load().decode([1, 300]) == procs.tokenizer.decode([1, 300])
