"""OpenAI routes and chat templates of the HTTP server against a fake scheduler (see
``fake_backend.py``): the official client (completions, chat, streams, n, logprobs), bad input (400
naming the field), and chat-template rendering (one BOS, --chat-template string/file/bad value).
"""

from __future__ import annotations

import json
import os

import pytest
import requests

from fake_backend import CONTEXT_LEN, MODEL, REPO, _wait_idle, fake_ids, srv  # noqa: F401 (srv: a fixture)
from sglang.srt.server_args import PortArgs, ServerArgs


OPENAI_BAD = [
    ("/v1/completions", {"model": "stories", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "top_p": 2}, "top_p"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"model": "stories", "prompt": "a " * 600}, "context length"),
    ("/v1/completions", "[1, 2", "JSON"),
    ("/v1/chat/completions", {"model": "stories", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "stories", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "stories", "messages": [{"role": "user", "content": "a"}],
                              "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"model": "stories", "messages": [{"role": "user", "content": "a"}],
                              "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", '{"model": "stories", "messages": [{"role": "user", "content": "a"}], '
                             '"temperature": NaN}', "temperature"),
    ("/v1/completions", '{"model": "stories", "prompt": "a", "top_p": -Infinity}', "top_p"),
]


@pytest.mark.parametrize("path, body, field", OPENAI_BAD)
def test_openai_bad_input_is_400_naming_the_field(srv, path, body, field):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(srv.url + path, data=data, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


# -------------------------------------------------------------------- OpenAI
def test_openai_client_completions_and_chat(srv):
    import openai

    tok = srv.tm.tokenizer
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    prompt = "Once upon a time"
    c = client.completions.create(model="stories", prompt=prompt, max_tokens=6, temperature=0)
    expect = fake_ids(tok.encode(prompt), 6)
    assert c.choices[0].text == tok.decode(expect)
    assert c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(tok.encode(prompt)), 6)
    stream = client.completions.create(model="stories", prompt=prompt, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage.total_tokens == c.usage.total_tokens
    c2 = client.completions.create(model="stories", prompt=[prompt, "The dog"], max_tokens=3, n=2, logprobs=2,
                                   echo=True)
    assert [ch.index for ch in c2.choices] == [0, 1, 2, 3]
    assert c2.choices[2].text.startswith("The dog")
    assert len(c2.choices[0].logprobs.tokens) == len(tok.encode(prompt)) + 3

    msgs = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "A cat"}]
    ids = srv.tm.apply_chat_template(msgs)
    chat = client.chat.completions.create(model="stories", messages=msgs, max_tokens=5, logprobs=True, top_logprobs=1)
    assert chat.choices[0].message.content == tok.decode(fake_ids(ids, 5))
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 5
    pieces_of = srv.tm.token_pieces  # exact in-sequence text and bytes (leading spaces kept)
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == [pieces_of.text_of(t) for t in fake_ids(ids, 5)]
    assert b"".join(bytes(t.bytes) for t in content) == b"".join(pieces_of.bytes_of(t) for t in fake_ids(ids, 5))
    stream = client.chat.completions.create(model="stories", messages=msgs, max_tokens=5, stream=True, n=2)
    pieces: dict[int, str] = {}
    finish = {}
    for ch in stream:
        for choice in ch.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert pieces == {0: chat.choices[0].message.content, 1: chat.choices[0].message.content}
    assert finish == {0: "length", 1: "length"}
    r = requests.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "stories"  # model may be omitted, as in SGLang
    assert r.json()["choices"][0]["text"] == c.choices[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories"]
    other = client.completions.create(model="gpt-4", prompt=prompt, max_tokens=6, temperature=0)
    assert other.choices[0].text == c.choices[0].text  # any model name is served, as SGLang does
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="stories", messages=msgs, temperature=-1)
    _wait_idle(srv.tm)


# ------------------------------------------------------------ chat template
def test_chat_template_has_one_bos_and_fallback_without_template():
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    llama3 = os.path.join(REPO, "..", "shared", "data", "tokenizers", "llama3")
    if not os.path.isdir(llama3) or not os.path.isdir(MODEL):
        pytest.skip("needs ../shared/data/tokenizers/llama3 and models/stories260K beside the repo")
    rng = __import__("random").Random(7)
    words = ["cat", "moon", "river", "blue", "seven"]
    msgs = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(4))},
            {"role": "user", "content": " ".join(rng.choice(words) for _ in range(6))}]
    info = {"context_len": 8192, "max_total_tokens": 1, "vocab_size": 128256, "max_req_input_len": 8000}
    tm = TokenizerManager(ServerArgs(model_path=llama3), PortArgs.init_new(), info)
    try:
        ids = tm.apply_chat_template(msgs)
        bos = tm.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
        assert ids[0] == bos and ids.count(bos) == 1
        text = tm.tokenizer.decode(ids)
        assert all(m["content"] in text for m in msgs)
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    finally:
        tm.close()
    info = {"context_len": CONTEXT_LEN, "max_total_tokens": 1, "vocab_size": 512, "max_req_input_len": 500}
    tm = TokenizerManager(ServerArgs(model_path=MODEL), PortArgs.init_new(), info)
    try:
        ids = tm.apply_chat_template(msgs)
        assert ids[0] == tm.tokenizer.bos_token_id and ids.count(tm.tokenizer.bos_token_id) == 1
        text = tm.tokenizer.decode(ids, skip_special_tokens=True)
        assert msgs[1]["content"] in text and text.rstrip().endswith("assistant:")
    finally:
        tm.close()


def test_chat_template_flag_string_file_and_bad_value(tmp_path):
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    if not os.path.isdir(MODEL):
        pytest.skip(f"stories260K checkpoint not found at {MODEL}")
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    info = {"context_len": CONTEXT_LEN, "max_total_tokens": 1, "vocab_size": 512, "max_req_input_len": 500}
    rng = __import__("random").Random(11)
    msgs = [{"role": "user", "content": " ".join(rng.choice(["sun", "dog", "tree"]) for _ in range(5))}]
    for value in (template, str(path)):
        tm = TokenizerManager(ServerArgs(model_path=MODEL, chat_template=value), PortArgs.init_new(), info)
        try:
            ids = tm.apply_chat_template(msgs)
            assert ids[0] == tm.tokenizer.bos_token_id and ids.count(tm.tokenizer.bos_token_id) == 1
            text = tm.tokenizer.decode(ids, skip_special_tokens=True)
            assert text == f"[user]{msgs[0]['content']}[assistant]"
        finally:
            tm.close()
    with pytest.raises(ValueError, match="chat-template"):
        TokenizerManager(ServerArgs(model_path=MODEL, chat_template="no-such-file.jinja"), PortArgs.init_new(), info)
