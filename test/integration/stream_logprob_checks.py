"""The streamed-logprob contract of SGLang's frontend test ``test_stream_logprobs`` (``sglang/test/test_programs.py``),
checked with this project's frontend and on the raw ``/generate`` SSE stream. Shared by the parity test modules (each
runs it against a server it already starts: the default cumulative stream and ``--incremental-streaming-output``)."""

from __future__ import annotations

import asyncio
import json

import requests

PROMPT = "Once upon a time"


def frontend_stream_chunks(url: str, max_new_tokens: int = 48, top_logprobs_num: int = 2) -> tuple[list, dict, str]:
    """Run one streamed greedy ``sgl.gen("answer", return_logprob=True)`` through ``text_async_iter("answer",
    return_meta_data=True)``; returns (the ``(chunk_text, meta_info)`` pairs, the variable's final meta_info, the
    non-streamed text of the same program)."""
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(url)

    @sgl.function
    def story(s):
        s += PROMPT
        s += sgl.gen("answer", max_tokens=max_new_tokens, temperature=0, ignore_eos=True, return_logprob=True,
                     top_logprobs_num=top_logprobs_num)

    async def collect(state):
        return [pair async for pair in state.text_async_iter("answer", return_meta_data=True)]

    full = story.run(backend=backend)
    state = story.run(backend=backend, stream=True)
    pairs = asyncio.run(collect(state))
    return pairs, state.get_meta_info("answer"), full["answer"]


def check_frontend_stream_logprobs(url: str) -> None:
    """SGLang's ``test_stream_logprobs`` assertions (every yielded chunk has text; ``completion_tokens ==
    output_token_logprobs_length``; the chunk's logprob list grows both by exactly its length), plus: the chunks
    concatenate to the non-streamed text, the top-logprob lists are cut the same way, and the chunks' lists
    concatenate to the final meta_info's (one entry per generated token)."""
    pairs, final, full_text = frontend_stream_chunks(url)
    assert len(pairs) > 1
    prev_tokens, lps, tops = 0, [], []
    for text, meta in pairs:
        assert text
        tokens, length = meta["completion_tokens"], meta["output_token_logprobs_length"]
        assert tokens == length
        assert len(meta["output_token_logprobs"]) == tokens - prev_tokens == len(meta["output_top_logprobs"])
        prev_tokens = tokens
        lps += meta["output_token_logprobs"]
        tops += meta["output_top_logprobs"]
    assert "".join(t for t, _ in pairs) == full_text
    assert len(final["output_token_logprobs"]) == final["completion_tokens"] == 48
    assert lps == final["output_token_logprobs"][:len(lps)] and tops == final["output_top_logprobs"][:len(tops)]


def raw_stream(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    """The ``data:`` events of one streamed ``/generate`` (``[DONE]`` checked and dropped)."""
    r = requests.post(url + "/generate", json={**body, "stream": True}, headers=headers or {}, stream=True,
                      timeout=300)
    assert r.status_code == 200, r.text
    lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
