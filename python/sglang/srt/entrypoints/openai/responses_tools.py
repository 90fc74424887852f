"""``tools`` / ``tool_choice`` of ``POST /v1/responses``, as SGLang serves them on a model without a tool-call parser.

Validation follows SGLang's protocol model (``ResponseTool``): ``type`` is one of :data:`RESPONSE_TOOL_TYPES` (any
other value is a 400 whose text lists them, pydantic's ``Input should be 'function', ... or 'tool_search'``), a
``function`` tool needs a ``name`` (``Function tools must include a name.``), other fields are typed and extra
fields are kept. What valid tools then do (SGLang's non-Harmony path without ``--tool-call-parser``; this server
has no tool-call parser):

* ``function`` tools, and ``custom`` tools as a function with one string property ``input``, are rendered into
  the chat template (``tools`` of ``apply_chat_template``; all of them for ``tool_choice`` ``"auto"`` /
  ``"required"``, only the named one for a named choice, none for ``"none"``). Built-in tool types (web search,
  file search, MCP, ...) and ``namespace`` tools pass validation and are not shown to the model. A ``shell`` tool is
  a 400 (``Shell tools are not supported by this model``).
* ``tool_choice`` ``"auto"`` / ``"none"``: the output is the model's text (a ``message`` item); no call is parsed
  out of it.
* ``tool_choice`` ``"required"`` or a named ``function`` / ``custom`` tool: decoding is constrained to a JSON array
  of ``{"name", "parameters"}`` objects (:func:`required_calls_schema`), which is parsed into ``function_call`` /
  ``custom_tool_call`` output items (:func:`parse_required_calls`); text that does not parse (e.g. cut by
  ``max_output_tokens``) stays a ``message``. ``"required"`` without a ``function`` / ``custom`` tool, and a named
  tool that is not declared, are 400s with SGLang's texts.

CPU-only, no server state.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, model_validator

RESPONSE_TOOL_TYPES = Literal[
    "function", "web_search", "web_search_preview", "code_interpreter", "file_search", "image_generation",
    "computer_use_preview", "local_shell", "shell", "mcp", "custom", "namespace", "tool_search",
]
"""Tool types SGLang's ``/v1/responses`` accepts (its ``RESPONSE_TOOL_TYPES``, in its order, which its 400 lists)."""

CALLABLE_TYPES = ("function", "custom")
"""Tool types the model can be made to call (rendered into the template, forceable through ``tool_choice``)."""

CUSTOM_INPUT_KEY = "input"
"""The one string property of the function a ``custom`` tool is shown as; its value is the call's ``input``."""


class ResponseTool(BaseModel):
    """One entry of ``tools`` (SGLang's field set; unknown fields are kept)."""

    model_config = ConfigDict(extra="allow")
    type: RESPONSE_TOOL_TYPES
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    defer_loading: Optional[bool] = None
    format: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _function_tool_has_a_name(self) -> "ResponseTool":
        if self.type == "function" and not self.name:
            raise ValueError("Function tools must include a name.")
        return self


ToolChoice = Union[Literal["auto", "required", "none"], dict[str, Any]]


def effective_tool_choice(choice: ToolChoice) -> Union[str, dict[str, str]]:
    """``choice`` as it can be honoured: a string as is; an object naming a ``function`` / ``custom`` tool (``name``
    or ``function.name``) as ``{"type", "name"}``; any other object (a built-in tool type) as ``"auto"``."""
    if not isinstance(choice, dict):
        return choice
    fn = choice.get("function")
    name = choice.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
    if choice.get("type") in CALLABLE_TYPES and name:
        return {"type": choice["type"], "name": name}
    return "auto"


def check_tools(tools: list[ResponseTool], choice: ToolChoice) -> None:
    """SGLang's request checks of ``tools`` against ``tool_choice``.

    Raises:
        ValueError: a ``shell`` tool; ``"required"`` without a ``function`` / ``custom`` tool; a named tool that is
            not declared (each with SGLang's text).
    """
    if any(t.type == "shell" for t in tools):
        raise ValueError("Shell tools are not supported by this model")
    if choice == "required" and not any(t.type in CALLABLE_TYPES for t in tools):
        raise ValueError('tool_choice="required" requires at least one tool with type="function" or type="custom"; '
                         "other built-in tool types cannot be forced.")
    eff = effective_tool_choice(choice)
    if isinstance(eff, dict) and not any(t.type in CALLABLE_TYPES and t.name == eff["name"] for t in tools):
        raise ValueError(f"Tool {eff['name']!r} is not declared in tools")


def _custom_description(tool: ResponseTool) -> Optional[str]:
    parts = [tool.description] if tool.description else []
    fmt = tool.format or {}
    if fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax") or "lark", fmt.get("definition") or ""
        parts.append(f"The input must follow this {syntax} grammar:\n{definition}")
    return "\n\n".join(parts) or None


def chat_tools(tools: list[ResponseTool]) -> list[dict[str, Any]]:
    """The ``function`` and ``custom`` tools in chat-completions form (``{"type": "function", "function": {"name",
    "description", "parameters", "strict"}}``), a ``custom`` tool as a function of one string ``input``."""
    out = []
    for t in tools:
        if t.type == "function":
            description, parameters = t.description, t.parameters
        elif t.type == "custom" and t.name:
            description = _custom_description(t)
            parameters = {"type": "object", "properties": {CUSTOM_INPUT_KEY: {"type": "string"}},
                          "required": [CUSTOM_INPUT_KEY], "additionalProperties": False}
        else:
            continue
        out.append({"type": "function", "function": {"name": t.name, "description": description,
                                                     "parameters": parameters, "strict": t.strict}})
    return out


def template_tools(tools: list[ResponseTool], choice: ToolChoice) -> Optional[list[dict[str, Any]]]:
    """The tools the chat template renders for ``choice``: none for ``"none"``, only the named one for a named
    choice, else every callable tool; None when there are none."""
    funcs = chat_tools(tools)
    eff = effective_tool_choice(choice)
    if eff == "none":
        return None
    if isinstance(eff, dict):
        funcs = [f for f in funcs if f["function"]["name"] == eff["name"]]
    return funcs or None


def _call_schema(func: dict[str, Any]) -> dict[str, Any]:
    params = func["function"].get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [func["function"]["name"]]},
                                             "parameters": params},
            "required": ["name", "parameters"]}


def required_calls_schema(tools: list[ResponseTool], choice: ToolChoice,
                          parallel_tool_calls: Optional[bool]) -> Optional[dict[str, Any]]:
    """The JSON schema a forced ``tool_choice`` constrains the output to, or None when nothing is forced.

    ``"required"``: an array (at least one item) of calls of any callable tool, each ``{"name": <the tool's name>,
    "parameters": <its parameters schema>}``, with the tools' ``$defs`` merged at the top; a named tool: an array
    of calls of that tool. ``parallel_tool_calls=False`` allows one call (``maxItems: 1``).

    Raises:
        ValueError: two tools define the same ``$defs`` entry differently.
    """
    eff = effective_tool_choice(choice)
    funcs = chat_tools(tools)
    if isinstance(eff, dict):
        funcs = [f for f in funcs if f["function"]["name"] == eff["name"]]
        if not funcs:
            return None
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": _call_schema(funcs[0])}
    elif eff == "required" and funcs:
        schema = {"type": "array", "minItems": 1,
                  "items": {"type": "object", "anyOf": [_call_schema(f) for f in funcs]}}
        defs: dict[str, Any] = {}
        for f in funcs:
            for name, sub in ((f["function"].get("parameters") or {}).get("$defs") or {}).items():
                if name in defs and defs[name] != sub:
                    raise ValueError(f"Tool definition '{name}' has multiple schemas, which is not supported.")
                defs[name] = sub
        if defs:
            schema["$defs"] = defs
    else:
        return None
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def parse_required_calls(text: str, tools: list[ResponseTool]) -> Optional[list[dict[str, Any]]]:
    """Output items for the JSON array a forced ``tool_choice`` produced: a ``function_call`` item (``arguments`` =
    the call's ``parameters`` as JSON text) per call of a function tool, a ``custom_tool_call`` item (``input``) per
    call of a custom tool; None when ``text`` is not such JSON (then it stays a message)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        return None
    custom = {t.name for t in tools if t.type == "custom" and t.name}
    items = []
    for call in data:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        params = call.get("parameters", {})
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        if call["name"] in custom:
            value = params.get(CUSTOM_INPUT_KEY) if isinstance(params, dict) else None
            items.append({"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex}", "call_id": call_id,
                          "name": call["name"],
                          "input": value if isinstance(value, str) else json.dumps(params, ensure_ascii=False)})
        else:
            items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id,
                          "name": call["name"], "arguments": json.dumps(params, ensure_ascii=False),
                          "status": "completed"})
    return items
