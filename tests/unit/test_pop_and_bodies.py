"""Popped jobs and the koboldcpp request bodies (seed steps 2, 4, 8)."""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

import pytest

from koboldcpp_horde_chat.errors import PayloadError
from koboldcpp_horde_chat.horde.pop import ChatJob, TextJob, parse_pop, validate_messages
from koboldcpp_horde_chat.translate.bodies import (
    OBJECT_JSON_GRAMMAR,
    chat_request_body,
    text_request_body,
)
from tests import pops

SEED_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
]


def seed_pop(**payload_changes: Any) -> dict[str, Any]:
    """The seed's chat job pop response ("One chat job in full")."""
    seed = {
        "messages": copy.deepcopy(SEED_MESSAGES),
        "temperature": 0.5,
        "stop_sequence": ["\nuser:"],
        "max_length": 512,
    }
    return pops.chat_pop("<job-id>", "<model-name>", full=True, **{**seed, **payload_changes})


def chat_job(**payload_changes: Any) -> ChatJob:
    job = parse_pop(seed_pop(**payload_changes))
    assert isinstance(job, ChatJob)
    return job


def path_of(pop: dict[str, Any]) -> str:
    with pytest.raises(PayloadError) as caught:
        parse_pop(pop)
    assert caught.value.job_id == "<job-id>"
    return caught.value.path


# --- parse_pop ------------------------------------------------------------------------


def test_the_seeds_chat_job_is_recognised() -> None:
    pop = seed_pop()
    job = parse_pop(pop)
    assert isinstance(job, ChatJob)
    assert job.id == "<job-id>"
    assert job.model == "<model-name>"
    assert job.ttl_s == 150.0
    assert job.messages == SEED_MESSAGES
    assert job.messages_url is None
    assert job.max_length == 512
    assert job.max_context_length == 2048
    assert job.stream_progress is False
    assert job.has_tools is False
    assert job.stop_sequences == ("\nuser:",)
    assert job.payload is pop["payload"]


@pytest.mark.parametrize("pop", [{}, {"id": None}, {"id": ""}, {"id": None, "skipped": {}}])
def test_a_pop_without_a_job_gives_none(pop: dict[str, Any]) -> None:
    assert parse_pop(pop) is None


@pytest.mark.parametrize("chat", [None, False, "true", 1])
def test_only_a_top_level_chat_true_makes_a_chat_job(chat: object) -> None:
    pop = {"id": "t1", "payload": {"prompt": "Once", "max_length": 80, "n": 1}, "ttl": 150}
    if chat is not None:
        pop["chat"] = chat
    job = parse_pop(pop)
    assert isinstance(job, TextJob)
    assert job.payload == {"prompt": "Once", "max_length": 80, "n": 1}


@pytest.mark.parametrize(("ttl", "expected"), [(300, 300.0), (12.5, 12.5), (0, 99.0), (-5, 99.0),
                                                (True, 99.0), ("150", 99.0), (None, 99.0)])
def test_ttl_falls_back_to_the_default_when_unusable(ttl: object, expected: float) -> None:
    pop = seed_pop()
    pop["ttl"] = ttl
    job = parse_pop(pop, default_ttl_s=99.0)
    assert job is not None
    assert job.ttl_s == expected


def test_an_offloaded_conversation_arrives_as_a_url() -> None:
    url = "https://store.example/chat/abc.json?X-Amz-Signature=1"
    job = chat_job(messages=..., messages_url=url)
    assert job.messages is None
    assert job.messages_url == url


@pytest.mark.parametrize("url", ["ftp://x/y", "", "file:///etc/passwd", "https://", 42, "x https://a"])
def test_a_messages_url_must_be_http(url: object) -> None:
    assert path_of(seed_pop(messages=..., messages_url=url)) == "payload.messages_url"


def test_a_chat_payload_without_messages_is_malformed() -> None:
    assert path_of(seed_pop(messages=...)) == "payload.messages"
    assert path_of(seed_pop(messages=[])) == "payload.messages"


@pytest.mark.parametrize("key", ["max_length", "max_context_length"])
@pytest.mark.parametrize("value", [..., 0, -1, True, "512", 512.0, None])
def test_budgets_must_be_positive_integers(key: str, value: object) -> None:
    assert path_of(seed_pop(**{key: value})) == f"payload.{key}"


def test_stream_progress_is_read() -> None:
    assert chat_job(stream_progress=True).stream_progress is True
    assert path_of(seed_pop(stream_progress="yes")) == "payload.stream_progress"


def test_the_payload_is_kept_as_sent() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    job = chat_job(tools=tools, tool_choice="required", x_future_field={"a": 1})
    assert job.has_tools is True
    assert job.payload["x_future_field"] == {"a": 1}
    assert job.payload["n"] == 1


@pytest.mark.parametrize(
    ("changes", "path"),
    [
        ({"stop_sequence": [1]}, "payload.stop_sequence[0]"),
        ({"stop_sequence": 5}, "payload.stop_sequence"),
        ({"tools": {"a": 1}}, "payload.tools"),
        ({"tools": ["x"]}, "payload.tools[0]"),
        ({"response_format": "json"}, "payload.response_format"),
        ({"response_format": {}}, "payload.response_format.type"),
    ],
)
def test_malformed_optional_fields_name_their_path(changes: dict[str, Any], path: str) -> None:
    assert path_of(seed_pop(**changes)) == path


def test_a_pop_that_is_not_an_object_or_has_no_payload_is_refused() -> None:
    with pytest.raises(PayloadError):
        parse_pop([])  # type: ignore[arg-type]
    assert path_of({"id": "<job-id>", "chat": True}) == "payload"


# --- validate_messages ----------------------------------------------------------------


def test_a_full_conversation_is_valid_and_returned_unchanged() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4A=="}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "look", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
        {"role": "assistant", "content": "A cat."},
    ]
    assert validate_messages(messages, job_id="j") is messages


@pytest.mark.parametrize(
    ("messages", "path"),
    [
        ("hi", "payload.messages"),
        ([], "payload.messages"),
        (["hi"], "payload.messages[0]"),
        ([{"role": "developer", "content": "x"}], "payload.messages[0].role"),
        ([{"content": "x"}], "payload.messages[0].role"),
        ([{"role": ["user"], "content": "x"}], "payload.messages[0].role"),
        ([{"role": {"a": 1}, "content": "x"}], "payload.messages[0].role"),
        ([{"role": "user", "content": 5}], "payload.messages[0].content"),
        ([{"role": "user", "content": ["x"]}], "payload.messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text"}]}], "payload.messages[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
         "payload.messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "https://x"}]}],
         "payload.messages[0].content[0].image_url"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         "payload.messages[0].content[0].image_url.url"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": {}}],
         "payload.messages[1].tool_calls"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}],
         "payload.messages[0].tool_calls[0].function.name"),
        ([{"role": "assistant", "tool_calls": ["x"]}], "payload.messages[0].tool_calls[0]"),
        ([{"role": "tool", "content": "r"}], "payload.messages[0].tool_call_id"),
    ],
)
def test_a_malformed_message_names_its_path(messages: object, path: str) -> None:
    with pytest.raises(PayloadError) as caught:
        validate_messages(messages, job_id="j")
    assert caught.value.path == path
    assert caught.value.job_id == "j"


def test_an_inline_malformed_message_faults_the_popped_job() -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]
    assert path_of(seed_pop(messages=bad)) == "payload.messages[1].role"


# --- chat_request_body ----------------------------------------------------------------


def test_the_seeds_job_becomes_a_chat_completion_request() -> None:
    job = chat_job()
    body = chat_request_body(job, job.messages or [], genkey="HORDEREQ_123", stream=False)
    assert body == {
        "messages": SEED_MESSAGES,
        "max_tokens": 512,
        "max_context_length": 2048,
        "temperature": 0.5,
        "top_p": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "rep_pen": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "stop": ["\nuser:"],
        "genkey": "HORDEREQ_123",
        "stream": False,
    }
    assert "n" not in body


def test_optional_fields_are_forwarded_unchanged() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "object"}}}]
    schema = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}
    job = chat_job(seed=42, reasoning_effort="low", tools=tools, tool_choice="required",
                   parallel_tool_calls=False, response_format=schema, stop_sequence=...)
    body = chat_request_body(job, SEED_MESSAGES, genkey="HORDEREQ_1", stream=False)
    assert body["seed"] == 42
    assert body["reasoning_effort"] == "low"
    assert body["tools"] == tools
    assert body["tool_choice"] == "required"
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == schema
    assert "grammar" not in body
    assert "stop" not in body


def test_json_object_is_sent_as_an_object_rooted_grammar() -> None:
    job = chat_job(response_format={"type": "json_object"})
    body = chat_request_body(job, SEED_MESSAGES, genkey="HORDEREQ_1", stream=False)
    assert "response_format" not in body
    assert body["grammar"] == OBJECT_JSON_GRAMMAR
    assert job.payload["response_format"] == {"type": "json_object"}


def test_a_streamed_request_asks_for_usage() -> None:
    body = chat_request_body(chat_job(), SEED_MESSAGES, genkey="HORDEREQ_1", stream=True)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_the_given_messages_are_sent_not_the_payloads() -> None:
    fetched = [{"role": "user", "content": "from the URL"}]
    job = chat_job(messages=..., messages_url="https://store.example/m")
    body = chat_request_body(job, fetched, genkey="HORDEREQ_1", stream=False)
    assert body["messages"] == fetched


# --- text jobs --------------------------------------------------------------------------


def test_a_text_payload_is_forwarded_unchanged_with_a_genkey() -> None:
    payload = {"prompt": "The capital of France is", "max_length": 48,
               "max_context_length": 2048, "temperature": 0.7, "rep_pen": 1.1, "n": 1}
    job = parse_pop({"id": "t", "payload": payload, "model": "koboldcpp/x"})
    assert isinstance(job, TextJob)
    before = copy.deepcopy(payload)
    body = text_request_body(job, genkey="HORDEREQ_555")
    assert body == {**before, "genkey": "HORDEREQ_555"}
    assert job.payload == before


# --- OBJECT_JSON_GRAMMAR, checked with a small GBNF matcher ---------------------------

Node = tuple[Any, ...]


class _Parser:
    """Parses the GBNF subset llama.cpp documents: literals, classes, groups, ? * + {m,n}."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t":
            self.i += 1

    def escape(self) -> str:
        c = self.text[self.i]
        self.i += 1
        if c == "x":
            value = chr(int(self.text[self.i : self.i + 2], 16))
            self.i += 2
            return value
        return {"n": "\n", "t": "\t", "r": "\r"}.get(c, c)

    def alternatives(self) -> Node:
        options = [self.sequence()]
        while self.i < len(self.text) and self.text[self.i] == "|":
            self.i += 1
            options.append(self.sequence())
        return ("alt", tuple(options))

    def sequence(self) -> Node:
        items: list[Node] = []
        while True:
            self.ws()
            if self.i >= len(self.text) or self.text[self.i] in "|)\n":
                return ("seq", tuple(items))
            items.append(self.quantified(self.atom()))

    def atom(self) -> Node:
        c = self.text[self.i]
        if c == '"':
            self.i += 1
            chars = []
            while self.text[self.i] != '"':
                if self.text[self.i] == "\\":
                    self.i += 1
                    chars.append(self.escape())
                else:
                    chars.append(self.text[self.i])
                    self.i += 1
            self.i += 1
            return ("lit", "".join(chars))
        if c == "[":
            self.i += 1
            negate = self.text[self.i] == "^"
            if negate:
                self.i += 1
            ranges: list[tuple[str, str]] = []
            while self.text[self.i] != "]":
                lo = self.char_in_class()
                hi = lo
                if self.text[self.i] == "-" and self.text[self.i + 1] != "]":
                    self.i += 1
                    hi = self.char_in_class()
                ranges.append((lo, hi))
            self.i += 1
            return ("class", negate, tuple(ranges))
        if c == "(":
            self.i += 1
            inner = self.alternatives()
            assert self.text[self.i] == ")"
            self.i += 1
            return inner
        start = self.i
        while self.i < len(self.text) and (self.text[self.i].isalnum() or self.text[self.i] in "-_"):
            self.i += 1
        assert self.i > start, f"unexpected {c!r} at {self.i}"
        return ("ref", self.text[start : self.i])

    def char_in_class(self) -> str:
        c = self.text[self.i]
        self.i += 1
        return self.escape() if c == "\\" else c

    def quantified(self, node: Node) -> Node:
        if self.i < len(self.text):
            c = self.text[self.i]
            if c in "?*+":
                self.i += 1
                return ("rep", node, {"?": 0, "*": 0, "+": 1}[c], {"?": 1, "*": None, "+": None}[c])
            if c == "{":
                end = self.text.index("}", self.i)
                lo, _, hi = self.text[self.i + 1 : end].partition(",")
                self.i = end + 1
                return ("rep", node, int(lo), int(hi) if hi else None)
        return node


def parse_gbnf(grammar: str) -> dict[str, Node]:
    rules: dict[str, Node] = {}
    for line in grammar.strip().splitlines():
        name, sep, expr = line.partition("::=")
        assert sep, line
        parser = _Parser(expr)
        rules[name.strip()] = parser.alternatives()
        assert parser.i == len(expr), f"trailing text in {line!r}"
    return rules


RULES = parse_gbnf(OBJECT_JSON_GRAMMAR)


def matches(text: str) -> bool:
    @cache
    def ends(node: Node, pos: int) -> frozenset[int]:
        kind = node[0]
        if kind == "lit":
            return frozenset([pos + len(node[1])]) if text.startswith(node[1], pos) else frozenset()
        if kind == "class":
            if pos >= len(text):
                return frozenset()
            inside = any(lo <= text[pos] <= hi for lo, hi in node[2])
            return frozenset([pos + 1]) if inside != node[1] else frozenset()
        if kind == "ref":
            return ends(RULES[node[1]], pos)
        if kind == "alt":
            return frozenset().union(*(ends(option, pos) for option in node[1]))
        if kind == "seq":
            current = frozenset([pos])
            for item in node[1]:
                current = frozenset().union(*(ends(item, p) for p in current))
            return current
        _, inner, lo, hi = node
        result = frozenset([pos]) if lo == 0 else frozenset()
        current, count = frozenset([pos]), 0
        while current and (hi is None or count < hi):
            current = frozenset().union(*(ends(inner, p) for p in current)) - {p for p in current}
            count += 1
            if count >= lo:
                result |= current
        return result

    return len(text) in ends(("ref", "root"), 0)


def test_the_grammar_defines_every_rule_it_uses_and_roots_at_an_object() -> None:
    assert RULES["root"] == ("alt", (("seq", (("ref", "object"),)),))

    def refs(node: Node) -> set[str]:
        if node[0] == "ref":
            return {node[1]}
        if node[0] in ("alt", "seq"):
            return set().union(*(refs(child) for child in node[1]))
        if node[0] == "rep":
            return refs(node[1])
        return set()

    used = set().union(*(refs(node) for node in RULES.values()))
    assert used <= set(RULES)
    assert set(RULES) - used == {"root"}
    assert {"value", "object", "array", "string", "number", "ws"} <= set(RULES)


@pytest.mark.parametrize(
    "text",
    [
        "{}",
        '{"name": "cat", "age": 3}',
        '{\n    "name": "cat",\n    "age": 1000000000000000\n}',
        '{"a": [1, -2.5e-3, "x\\n\\u00e9", true, false, null, {"b": []}]}',
        '{"é": "日本"}',
        "{ }",
    ],
)
def test_the_grammar_accepts_json_objects(text: str) -> None:
    json.loads(text)
    assert matches(text)


@pytest.mark.parametrize(
    "text",
    [
        '[\n"cat"\n]',  # what koboldcpp's own json_object grammar produced (chat_json_object)
        '"cat"',
        "1",
        "null",
        '{"a": }',
        '{"a": 01}',
        '{"a": 1,}',
        "{} {}",
        '{"a": "\x01"}',
        "{'a': 1}",
        " {}",
    ],
)
def test_the_grammar_refuses_anything_but_one_object(text: str) -> None:
    assert not matches(text)


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("temperature", "NaN", "payload.temperature"),
        ("top_p", "abc", "payload.top_p"),
        ("presence_penalty", [1], "payload.presence_penalty"),
        ("top_k", True, "payload.top_k"),
        ("min_p", float("nan"), "payload.min_p"),
        ("seed", "x", "payload.seed"),
        ("seed", 1.5, "payload.seed"),
    ],
)
def test_a_sampler_of_the_wrong_type_is_a_payload_error(field: str, value: object, path: str) -> None:
    pop = {
        "id": "j1",
        "chat": True,
        "payload": {
            "messages": [{"role": "user", "content": "hi"}],
            "max_length": 16,
            "max_context_length": 1024,
            field: value,
        },
    }
    with pytest.raises(PayloadError) as info:
        parse_pop(pop)
    assert info.value.path == path and info.value.job_id == "j1"


@pytest.mark.parametrize("payload", [{}, {"prompt": 42}, {"prompt": None}])
def test_a_text_job_without_a_string_prompt_is_a_payload_error(payload: dict[str, object]) -> None:
    with pytest.raises(PayloadError) as info:
        parse_pop({"id": "t1", "payload": payload})
    assert info.value.path == "payload.prompt" and info.value.job_id == "t1"
