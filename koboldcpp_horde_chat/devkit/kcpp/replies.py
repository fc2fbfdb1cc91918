"""Scripted replies and injected faults: :meth:`ScriptedKoboldcpp.script`,
:meth:`ScriptedKoboldcpp.inject`, and the default replies (tool calls, structured
output, canned answers) planned for a chat or a Kobold API body.
"""

from __future__ import annotations

import json
import random
import re
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from koboldcpp_horde_chat.devkit.kcpp.model import (
    ScriptedReply,
    _content_text,
    _int_or_none,
    _Plan,
    _render_chat,
)
from koboldcpp_horde_chat.devkit.kcpp.state import KcppCore
from koboldcpp_horde_chat.devkit.kcpp.values import IMAGE_TOKENS, ROUTE_NAMES, Fault

_LONG_STORY = " ".join(
    [
        "Once upon a time a small fox lived at the edge of a quiet forest.",
        "Every morning she walked to the river to watch the light on the water.",
        "The birds told her stories of the mountains far away,",
        "and the old oak by the path remembered every winter it had seen.",
    ]
    * 40
)


def _last_user_text(messages: list[Any]) -> tuple[str, int]:
    for msg in reversed(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            return _content_text(msg.get("content"))
    return "", 0


def _default_answer(text: str, images: int) -> str:
    """The canned answer to a user message (see the module docstring)."""
    low = text.lower()
    if "colour" in low or "color" in low:
        return "Blue."
    if any(word in low for word in ("story", "essay", "long")):
        return _LONG_STORY
    if images:
        return f"I see {images} image{'s' if images != 1 else ''}."
    words = re.sub(r"\(Attached Image \d+\)", "", text).split()
    if not words:
        return "Hello."
    return "You said: " + " ".join(words[:8]).rstrip(".?!,;:") + "."


def example_value(schema: Any, depth: int = 0) -> Any:
    """A plausible JSON value satisfying a simple JSON schema.

    Handles ``const``, ``enum``, ``anyOf``/``oneOf``/``allOf`` (first branch),
    ``type`` (string, list of strings), ``object`` (its ``required``
    properties, or all properties when ``required`` is absent), ``array`` (one
    item, or none without ``items``), strings, numbers, booleans and null.
    """
    if not isinstance(schema, dict) or depth > 8:
        return "example"
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example_value(schema[key][0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind is None and isinstance(schema.get("properties"), dict):
        kind = "object"
    if kind == "object":
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = schema.get("required")
        names = (
            [n for n in required if isinstance(n, str)]
            if isinstance(required, list)
            else list(props)
        )
        return {name: example_value(props.get(name, {}), depth + 1) for name in names}
    if kind == "array":
        items = schema.get("items")
        count = max(1, _int_or_none(schema.get("minItems")) or 0) if items is not None else 0
        return [example_value(items, depth + 1) for _ in range(count)]
    if kind == "integer":
        return max(1, _int_or_none(schema.get("minimum")) or 0)
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "example"


_RULE_RE = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*::=\s*(.*)$")
_ELEMENT_RE = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z0-9_-]+|\(|\)|\||[*+?]')


def grammar_root_kind(grammar: str) -> Literal["object", "array", "other"]:
    """Whether a GBNF grammar's ``root`` starts with ``{``, ``[`` or anything else.

    Follows rule references from ``root`` to the first literal, skipping rules
    that may match nothing (whitespace rules such as ``ws ::= [ \\t\\n]*``).
    """
    rules: dict[str, str] = {}
    current: str | None = None
    for line in grammar.splitlines():
        if line.lstrip().startswith("#"):
            continue
        stripped = line
        match = _RULE_RE.match(stripped)
        if match:
            current = match.group(1)
            rules[current] = match.group(2)
        elif current is not None and stripped.strip():
            rules[current] += " " + stripped.strip()

    def first(rule: str, seen: frozenset[str]) -> str | None:
        if rule in seen or rule not in rules:
            return None
        element: str
        for element in _ELEMENT_RE.findall(rules[rule]):
            if element in ("(", ")", "*", "+", "?"):
                continue
            if element == "|":
                return None
            if element.startswith('"'):
                literal = element[1:-1]
                if literal:
                    return literal[0]
                continue
            if element.startswith("["):
                return None
            if _may_be_empty(rules.get(element, "")):
                continue
            return first(element, seen | {rule})
        return None

    char = first("root", frozenset())
    if char == "{":
        return "object"
    if char == "[":
        return "array"
    return "other"


def _may_be_empty(rhs: str) -> bool:
    """A rule such as ``( [ \\t\\n] ... )?`` or ``[ \\t\\n]*`` that may match nothing."""
    text = rhs.strip()
    return bool(text) and (text.endswith(")?") or text.endswith("]*") or text.endswith(")*"))


def _normalise_scripted_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for call in calls:
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        assert isinstance(fn, dict)
        args = fn.get("arguments", {})
        out.append(
            {
                "id": str(call.get("id") or _mint_call_id()),
                "type": "function",
                "function": {
                    "name": str(fn.get("name", "")),
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    return out


def _mint_call_id() -> str:
    return f"call_{random.randint(10000, 99999)}"


def check_fault(fault: Fault) -> None:
    """Raise ValueError unless ``fault`` is one :meth:`ScriptedReplies.inject` takes."""
    if isinstance(fault, tuple):
        if len(fault) != 2 or not isinstance(fault[0], int):
            raise ValueError(f"a fault tuple is (status, body), got {fault!r}")
    elif not isinstance(fault, str):
        raise ValueError(f"a fault is a (status, body) tuple or a name, got {fault!r}")
    elif fault.startswith("hang:"):
        float(fault[5:])
    elif fault.startswith("stall:"):
        float(fault[6:])
    elif fault not in ("reset", "truncate", "stream_cut", "stream_error", "no_finish"):
        raise ValueError(f"unknown fault {fault!r}")


class ScriptedReplies(KcppCore):
    """What the model generates for a body, and the faults queued per route."""

    def script(self, fn: Callable[[dict[str, Any]], ScriptedReply | None] | None) -> None:
        """Set ``fn(body) -> ScriptedReply | None`` for chat and generate (None: default reply).

        ``script(None)`` removes it.
        """
        self._script = fn

    def inject(self, route: str, *responses: Fault) -> None:
        """Queue faults for the next requests on ``route`` (one per request, in order).

        Routes: the values of :data:`GET_ROUTES` and :data:`POST_ROUTES`
        (``"chat"``, ``"generate"``, ``"tokencount"``, ``"abort"``, ``"perf"``,
        ``"version"``, ``"info_version"``, ``"model"``...). Each response is:

        * ``(status, body)``: answered at once as JSON (``body`` may be a dict,
          list, str or bytes; str and bytes are sent as they are);
        * ``"reset"``: the connection is reset (TCP RST) without an answer;
        * ``"hang:<s>"``: wait ``s`` seconds (released by ``stop()``), then serve
          the request normally;
        * ``"truncate"``: the normal answer with its full ``content-length`` but
          only half the body, then close (a stream is cut like ``stream_cut``);
        * ``"stream_cut"``: a stream stops after half its tokens, in the middle
          of a ``data:`` line, and the connection closes (no ``[DONE]``); on a
          JSON route it acts like ``"truncate"``;
        * ``"stream_error"``: after half its tokens a chat stream sends an
          in-band error event (:data:`STREAM_ERROR_EVENT`) and then goes on
          generating and streaming as if nothing happened;
        * ``"no_finish"``: a chat stream's final chunk carries
          ``finish_reason: null``; usage and ``[DONE]`` follow as usual;
        * ``"stall:<s>"``: a chat stream goes silent for ``s`` seconds after
          half its tokens, then carries on.

        The last three apply to streamed chat completions only.

        Raises ValueError for an unknown route or fault.
        """
        if route not in ROUTE_NAMES:
            raise ValueError(f"unknown route {route!r}; known: {sorted(ROUTE_NAMES)}")
        for fault in responses:
            check_fault(fault)
        with self._lock:
            self._faults.setdefault(route, deque()).extend(responses)

    def fail_when(self, rule: Callable[[str, Any], Fault | None] | None) -> None:
        """Set a standing rule of faults: ``rule(route, body)`` is asked for every
        request that has no fault queued by :meth:`inject` and returns a fault (as
        :meth:`inject` takes them) or None to serve the request normally.

        It fails requests by what they are rather than by their order, so failures
        interleave with successes: e.g. every chat completion (route ``"chat"``)
        fails while text generations (``"generate"``) are served, or only the
        requests whose prompt holds a marker fail. ``fail_when(None)`` removes it.
        A fault the rule returns that :meth:`inject` would refuse is answered 500.
        """
        self._fail_rule = rule

    def _standing_fault(self, route: str, body: Any) -> Fault | None:
        rule = self._fail_rule
        if rule is None:
            return None
        fault = rule(route, body)
        if fault is None:
            return None
        try:
            check_fault(fault)
        except (ValueError, TypeError, AttributeError):
            return (500, {"detail": {"msg": f"bad scripted fault {fault!r}"}})
        return fault

    def _scripted(self, body: dict[str, Any]) -> ScriptedReply | None:
        fn = self._script
        return fn(body) if fn is not None else None

    def _plan_chat(self, body: dict[str, Any]) -> _Plan:
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        tools = [t for t in tools or [] if isinstance(t, dict)] or None
        rendered, images = _render_chat(messages, tools)
        prompt_tokens = 1 + self.tokenizer.count(rendered)
        if self.vision:
            prompt_tokens += images * IMAGE_TOKENS

        scripted = self._scripted(body)
        choice = body.get("tool_choice", "auto")
        chosen = self._choose_tool(tools, choice, messages)
        if scripted is not None:
            reasoning = (
                f"<think>{scripted.reasoning}</think>" if scripted.reasoning is not None else ""
            )
            if scripted.prompt_tokens is not None:
                prompt_tokens = scripted.prompt_tokens
            if scripted.tool_calls and tools:
                calls = _normalise_scripted_calls(scripted.tool_calls)
                return _Plan(
                    reasoning + self._tool_json(calls), scripted.finish, prompt_tokens, calls, True
                )
            return _Plan(reasoning + scripted.text, scripted.finish, prompt_tokens)

        if chosen is not None:
            fn = chosen.get("function") if isinstance(chosen.get("function"), dict) else chosen
            assert isinstance(fn, dict)
            args = example_value(fn.get("parameters") or {"type": "object"})
            calls = [
                {
                    "id": _mint_call_id(),
                    "type": "function",
                    "function": {"name": str(fn.get("name", "")), "arguments": json.dumps(args)},
                }
            ]
            return _Plan(self._tool_json(calls), "eos", prompt_tokens, calls, True)

        user_text, user_images = _last_user_text(messages)
        last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
        if last.get("role") == "tool":
            result, _ = _content_text(last.get("content"))
            answer = f"The tool returned: {result.strip()[:200]}"
        else:
            answer = _default_answer(user_text, user_images)
        answer = self._format_answer(body, answer)
        if "think" in user_text.lower():
            words = " ".join(user_text.split()[:12])
            thought = f"The user wrote: {words} I will answer briefly."
            return _Plan(f"<think>\n{thought}\n</think>\n\n{answer}", "eos", prompt_tokens)
        return _Plan(answer, "eos", prompt_tokens)

    @staticmethod
    def _format_answer(body: dict[str, Any], answer: str) -> str:
        """Structured output: json_schema -> object, json_object -> array, grammar -> its root."""
        fmt = body.get("response_format")
        schema: Any = None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema", {}) if isinstance(spec, dict) else {}
        elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
            return "[\n" + json.dumps(answer) + "\n]"
        elif isinstance(body.get("json_schema"), dict):
            schema = body["json_schema"]
        if schema is not None:
            return json.dumps(example_value(schema or {"type": "object"}), indent=2)
        grammar = body.get("grammar")
        if isinstance(grammar, str) and grammar.strip():
            kind = grammar_root_kind(grammar)
            if kind == "object":
                return json.dumps({"answer": answer}, indent=2)
            if kind == "array":
                return "[\n" + json.dumps(answer) + "\n]"
        return answer

    @staticmethod
    def _choose_tool(
        tools: list[dict[str, Any]] | None, choice: Any, messages: list[Any]
    ) -> dict[str, Any] | None:
        """The tool the default reply calls, or None (1.116.1 ``koboldcpp.py`` L4021-4125)."""
        if not tools or choice is None or choice == "none":
            return None

        def by_name(name: Any) -> dict[str, Any] | None:
            if not isinstance(name, str):
                return None
            for tool in tools:
                fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
                if isinstance(fn, dict) and str(fn.get("name", "")).lower() == name.lower():
                    return tool
            return None

        if isinstance(choice, dict):
            fn = choice.get("function")
            named = by_name(fn.get("name") if isinstance(fn, dict) else None)
            if named is not None:
                return named
            choice = "auto"
        elif isinstance(choice, str) and choice not in ("auto", "required"):
            named = by_name(choice)
            if named is not None:
                return named
            choice = "auto"
        last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
        if choice == "auto" and last.get("role") == "tool":
            return None
        return tools[0]

    @staticmethod
    def _tool_json(calls: list[dict[str, Any]]) -> str:
        return json.dumps(
            [
                {
                    "id": "call_001",
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"] or "{}"),
                    },
                }
                for c in calls
            ]
        )

    def _plan_kobold(self, body: dict[str, Any]) -> _Plan:
        prompt = body.get("prompt")
        prompt = prompt if isinstance(prompt, str) else ""
        memory = body.get("memory")
        memory = memory if isinstance(memory, str) else ""
        prompt_tokens = 1 + self.tokenizer.count(memory + prompt)
        scripted = self._scripted(body)
        if scripted is not None:
            reasoning = (
                f"<think>{scripted.reasoning}</think>" if scripted.reasoning is not None else ""
            )
            if scripted.prompt_tokens is not None:
                prompt_tokens = scripted.prompt_tokens
            return _Plan(reasoning + scripted.text, scripted.finish, prompt_tokens)
        lines = [line for line in prompt.splitlines() if line.strip()]
        answer = _default_answer(lines[-1] if lines else "", 0)
        return _Plan(" " + answer, "eos", prompt_tokens)
