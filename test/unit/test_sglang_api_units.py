"""SGLang API parity below the HTTP layer: ``CustomLogitProcessor`` under SGLang's module path and
wire format, the ``/v1/score`` helpers, the chat tool checks with SGLang's error texts, and the ``/v1/responses``
usage fields and tools. CPU-only, no server."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from sglang.srt.entrypoints.openai.responses_tools import (  # noqa: E402
    ResponseTool,
    parse_required_calls,
    required_calls_schema,
    template_tools,
)
from sglang.srt.entrypoints.openai.serving_chat import check_tools, template_tools_of  # noqa: E402
from sglang.srt.entrypoints.openai.serving_responses import (  # noqa: E402
    OpenAIServingResponses,
    ResponsesRequest,
    usage_of_output,
)
from sglang.srt.entrypoints.openai.serving_score import ScoringRequest, label_scores, score_prompts  # noqa: E402
from sglang.srt.sampling.custom_logit_processor import (  # noqa: E402
    CustomLogitProcessor,
    DisallowedTokensLogitsProcessor,
    ProcessorCache,
)

VOCAB = 64


# ------------------------------------------------------- custom processors
def _deterministic_class():
    """SGLang's test processor, defined locally as SGLang's tests do (dill pickles it by value)."""

    class DeterministicLogitProcessor(CustomLogitProcessor):
        def __call__(self, logits, custom_param_list):
            assert logits.shape[0] == len(custom_param_list)
            for i, param_dict in enumerate(custom_param_list):
                logits[i, :] = -float("inf")
                logits[i, param_dict["token_id"]] = 0.0
            return logits

    return DeterministicLogitProcessor


def test_sglang_processor_wire_format_loads_and_runs():
    pytest.importorskip("dill")
    cls = _deterministic_class()
    for wire in (cls.to_str(), cls().to_str()):  # SGLang's clients call it on the class or an instance
        data = json.loads(wire)
        assert set(data) == {"callable"}
        # the base class travels by reference to SGLang's module path, which must resolve here
        assert b"sglang.srt.sampling.custom_logit_processor" in bytes.fromhex(data["callable"])
        loaded = CustomLogitProcessor.from_str(wire)
        assert isinstance(loaded, CustomLogitProcessor) and type(loaded).__name__ == "DeterministicLogitProcessor"
        logits = torch.randn(3, VOCAB)
        errors = ProcessorCache().apply(logits, [wire, None, wire], [{"token_id": 5}, None, {"token_id": 9}])
        assert not errors
        assert logits[0].argmax().item() == 5 and logits[2].argmax().item() == 9
        assert torch.isinf(logits[0]).sum().item() == VOCAB - 1 and torch.isfinite(logits[1]).all()


def test_base_class_is_abstract_and_bad_payloads_are_named():
    with pytest.raises(TypeError):
        CustomLogitProcessor()
    pytest.importorskip("dill")
    with pytest.raises(ValueError, match="custom_logit_processor could not be loaded"):
        CustomLogitProcessor.from_str(json.dumps({"callable": "00ff"}))


def test_disallowed_tokens_processor():
    logits = torch.zeros(2, VOCAB)
    out = DisallowedTokensLogitsProcessor()(logits, [{"token_ids": [3, 4]}, None])
    assert torch.isinf(out[0, [3, 4]]).all() and torch.isfinite(out[1]).all() and torch.isfinite(out[0, 5])


# ------------------------------------------------------------------ score
def test_score_prompts_text_ids_item_first_and_errors():
    req = ScoringRequest(query="Q", items=["a", "b"], label_token_ids=[1, 2])
    assert score_prompts(req, VOCAB) == (["Qa", "Qb"], None)
    req.item_first = True
    assert score_prompts(req, VOCAB) == (["aQ", "bQ"], None)
    assert score_prompts(ScoringRequest(query="Q", items="a", label_token_ids=[1]), VOCAB) == (["Qa"], None)
    ids = ScoringRequest(query=[1, 2], items=[[3], [4, 5]], label_token_ids=[7])
    assert score_prompts(ids, VOCAB) == (None, [[1, 2, 3], [1, 2, 4, 5]])
    cases = [
        (dict(query="Q", items=["a"], label_token_ids=[999999]), r"^Token ID 999999 is out of vocabulary \(vocab size"),
        (dict(query="Q", items=["a"], label_token_ids=[-1]), "^label_token_ids must be token ids"),
        (dict(query="Q", items=["a"]), "^label_token_ids must be provided"),
        (dict(query="Q", label_token_ids=[1]), "^items must be provided"),
        (dict(query="Q", items=[[1]], label_token_ids=[1]), "Invalid combination of query/items types"),
        (dict(query=[1], items=[[VOCAB]], label_token_ids=[1]), r"^items\[0\]: token ids must lie in"),
    ]
    for body, msg in cases:
        with pytest.raises(ValueError, match=msg):
            score_prompts(ScoringRequest(**body), VOCAB)


def test_label_scores_softmax_exp_and_masked_labels():
    entries = [[math.log(0.2), 4, None], [math.log(0.05), 9, None], [None, 11, None]]
    assert label_scores(entries, [9, 4, 11], False) == pytest.approx([0.05, 0.2, 0.0])
    soft = label_scores(entries, [4, 9, 11], True)
    assert soft == pytest.approx([0.8, 0.2, 0.0]) and sum(soft) == pytest.approx(1.0, abs=1e-12)
    assert all(isinstance(v, float) for v in soft)
    with pytest.raises(RuntimeError):
        label_scores([], [4], True)


# ------------------------------------------------------------------ tools
def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **kw})


def _tool(name="f", parameters=None):
    fn = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def test_tool_checks_use_sglang_texts():
    pytest.importorskip("jsonschema")
    check_tools(_chat(tools=[_tool(parameters={"type": "object", "properties": {"a": {"type": "integer"}}})],
                      tool_choice={"type": "function", "function": {"name": "f"}}))
    cases = [
        (dict(tool_choice="required"), r"^Tools cannot be empty if tool choice is set to required\.$"),
        (dict(tool_choice={"type": "function", "function": {"name": "f"}}),
         r"^Tools cannot be empty if tool choice is set to a specific tool\.$"),
        (dict(tools=[_tool()], tool_choice={"type": "function", "function": {"name": "g"}}),
         r"^Tool 'g' not found in tools list\.$"),
        (dict(tools=[_tool(), _tool("h", {"type": "nope"})]), r"^Tool 1 function has invalid 'parameters' schema: "),
        (dict(tools=[{"type": "function"}]), r"^tools\[0\]\.function\.name is required"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_tools(_chat(**kw))
    # the chat template sees no tools for "none", only the named one for a named choice (SGLang)
    two = [_tool(), _tool("g")]
    assert template_tools_of(_chat(tools=two)) == two == template_tools_of(_chat(tools=two, tool_choice="required"))
    assert template_tools_of(_chat(tools=two, tool_choice="none")) is None
    assert template_tools_of(_chat(tools=two, tool_choice={"type": "function", "function": {"name": "g"}})) == two[1:]


def test_responses_usage_has_openai_and_sglang_fields():
    u = usage_of_output({"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 2})
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == (7, 3, 10)
    assert (u["prompt_tokens"], u["completion_tokens"]) == (7, 3)
    assert u["input_tokens_details"] == {"cached_tokens": 2}


# ------------------------------------------------------- /v1/responses tools
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "$defs": {"unit": {"enum": ["C", "F"]}}}}
NOTE = {"type": "custom", "name": "note", "description": "Write a note",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[a-z]+/"}}


class _RecordingTokenizerManager:
    """What ``OpenAIServingResponses._to_generate`` calls on the tokenizer manager, recording the template's tools."""

    context_len = 512

    def __init__(self):
        self.tools = "unset"

    def apply_chat_template(self, messages, tools=None):
        self.tools = tools
        return [1, 2, 3]


def _to_generate(**body):
    tm = _RecordingTokenizerManager()
    req = ResponsesRequest.model_validate({"input": "hi", **body})
    obj, forced = OpenAIServingResponses(tm, None)._to_generate(req)
    return tm.tools, obj.sampling_params.get("json_schema"), forced


def test_responses_tools_reach_the_template_and_forced_choices_constrain_the_output():
    tools = [WEATHER, NOTE, {"type": "web_search"}, {"type": "mcp", "server_label": "x"}]
    rendered, schema, forced = _to_generate(tools=tools)
    assert [t["function"]["name"] for t in rendered] == ["get_weather", "note"] and schema is None and not forced
    assert rendered[0]["function"]["parameters"] == WEATHER["parameters"]
    assert rendered[1]["function"]["parameters"]["required"] == ["input"]  # a custom tool: one string "input"
    assert "start: /[a-z]+/" in rendered[1]["function"]["description"]
    assert _to_generate(tools=tools, tool_choice="none")[:2] == (None, None)
    rendered, schema, forced = _to_generate(tools=tools, tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(schema)
    assert forced and len(rendered) == 2 and schema["minItems"] == 1 == schema["maxItems"]
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["get_weather"], ["note"]]
    assert schema["$defs"] == WEATHER["parameters"]["$defs"]
    rendered, schema, _ = _to_generate(tools=tools, tool_choice={"type": "function", "name": "get_weather"})
    schema = json.loads(schema)
    assert [t["function"]["name"] for t in rendered] == ["get_weather"] and "maxItems" not in schema
    assert schema["items"]["properties"]["parameters"] == WEATHER["parameters"]
    other = {**WEATHER, "name": "w2", "parameters": {"type": "object", "$defs": {"unit": {"enum": ["K"]}}}}
    with pytest.raises(ValueError, match="Tool definition 'unit' has multiple schemas"):
        required_calls_schema([ResponseTool(**WEATHER), ResponseTool(**other)], "required", None)


def test_responses_tool_validation_uses_sglang_texts():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="Input should be 'function', 'web_search', "
                                                       "'web_search_preview', 'code_interpreter', 'file_search', "
                                                       "'image_generation', 'computer_use_preview', 'local_shell', "
                                                       "'shell', 'mcp', 'custom', 'namespace' or 'tool_search'"):
        ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "retrieval"}]})
    with pytest.raises(pydantic.ValidationError, match="Function tools must include a name."):
        ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function"}]})
    with pytest.raises(pydantic.ValidationError, match="tool_choice"):
        ResponsesRequest.model_validate({"input": "x", "tool_choice": "sometimes"})
    kept = ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "mcp", "server_label": "s"}]})
    assert kept.tools[0].model_dump()["server_label"] == "s"  # unknown fields are kept (echoed back)
    cases = [
        (dict(tools=[{"type": "shell"}]), r"^Shell tools are not supported by this model$"),
        (dict(tools=[{"type": "web_search"}], tool_choice="required"),
         r'^tool_choice="required" requires at least one tool with type="function" or type="custom"; '),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "f"}), r"^Tool 'f' is not declared in tools$"),
        (dict(tools=[{**WEATHER, "parameters": {"type": 5}}]), r"^Tool 0 function has invalid 'parameters' schema: "),
    ]
    for body, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _to_generate(**body)


def test_parse_required_calls():
    tools = [ResponseTool(**WEATHER), ResponseTool(**NOTE)]
    items = parse_required_calls('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                                 '{"name": "note", "parameters": {"input": "buy milk"}}]', tools)
    assert [i["type"] for i in items] == ["function_call", "custom_tool_call"]
    assert json.loads(items[0]["arguments"]) == {"city": "Paris"} and items[0]["status"] == "completed"
    assert items[1]["input"] == "buy milk" and items[0]["call_id"] != items[1]["call_id"]
    assert parse_required_calls('{"name": "get_weather", "parameters": {}}', tools)[0]["arguments"] == "{}"
    assert parse_required_calls('[{"name": "get_weather", "param', tools) is None  # cut: stays a message
    assert parse_required_calls("[]", tools) == []
    assert template_tools([ResponseTool(type="web_search")], "auto") is None
