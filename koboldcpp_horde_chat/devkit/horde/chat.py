"""The chat contract: a client's chat request checked and turned into what a worker
must declare (its spec), the job's payload (step 2) and the submit's checks (step 6,
"Submit refusals").
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable
from typing import Any

from koboldcpp_horde_chat.devkit.horde.helpers import _ApiError, _is_int, _is_number, _job_answer
from koboldcpp_horde_chat.devkit.horde.images import ObjectStore, _image_parts
from koboldcpp_horde_chat.devkit.horde.leases import Leases
from koboldcpp_horde_chat.devkit.horde.state import _ChatSpec, _Declaration, _Job, _Req
from koboldcpp_horde_chat.devkit.horde.values import (
    _ROLES,
    FINISH_REASONS,
    MAX_TOKEN_COUNT,
    NATIVE_FINISH_REASON_MAX_CHARS,
    REASONING_MAX_BYTES,
)

try:  # optional: a test extra; without it the strict json_schema check is skipped
    _jsonschema: Any = importlib.import_module("jsonschema")
except ImportError:  # pragma: no cover - depends on the environment
    _jsonschema = None


def _validate_chat_body(body: Any) -> None:
    """Check a client's chat request; raises ``ValueError`` naming the field."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools must be a list")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tools[{i}].function.name is required")
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        names = {t["function"]["name"] for t in tools or []}
        if name not in names:
            raise ValueError("tool_choice.function.name must name one of the tools")
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise ValueError("tool_choice must be none, auto, required or a function")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format.type must be text, json_object or json_schema")
        if rf.get("type") == "json_schema" and not isinstance(rf.get("json_schema"), dict):
            raise ValueError("response_format.json_schema must be an object")
    for key in ("max_tokens", "max_completion_tokens", "max_context_length"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{key} must be a positive integer")
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        value = body.get(key)
        if value is not None and not _is_number(value):
            raise ValueError(f"{key} must be a number")


def _parallel_off(body: dict[str, Any]) -> bool:
    """True when the client set ``parallel_tool_calls: false``."""
    return body.get("parallel_tool_calls") is False


class ChatContract(ObjectStore, Leases):
    """A chat request's spec, its job payload and its submit's checks."""

    def _chat_spec(self, body: dict[str, Any], *, best_effort: bool) -> _ChatSpec:
        messages: list[dict[str, Any]] = []
        for message in body["messages"]:
            m = copy.deepcopy(message)
            if m.get("role") == "developer":
                m["role"] = "system"  # ADR 0033: a developer message arrives as system
            messages.append(m)
        tools = list(body.get("tools") or [])
        tool_names = {t["function"]["name"] for t in tools}
        choice = body.get("tool_choice")
        named = None
        if isinstance(choice, dict):
            named = choice["function"]["name"]
        forwards_tools = bool(tools) and choice != "none"
        history_tools = any(
            m.get("role") == "tool" or m.get("tool_calls") for m in messages
        )
        rf = body.get("response_format")
        rf_type = rf.get("type") if isinstance(rf, dict) else None
        if rf_type not in ("json_object", "json_schema"):
            rf_type = None
        schema = None
        schema_strict = False
        if rf_type == "json_schema":
            js = rf["json_schema"] if isinstance(rf, dict) else {}
            schema = js.get("schema") if isinstance(js.get("schema"), dict) else None
            schema_strict = js.get("strict") is True
        features: set[str] = set()
        guarantees: set[str] = set()
        if forwards_tools or history_tools:
            features.add("tools")
        if rf_type:
            features.add(rf_type)
        if body.get("seed") is not None:
            features.add("seed")
        for penalty in ("presence_penalty", "frequency_penalty"):
            if body.get(penalty) not in (None, 0, 0.0):  # not OpenAI's default
                features.add(penalty)
        if forwards_tools and rf_type:
            features.add("tools_with_response_format")
        has_images = any(True for _ in _image_parts(messages))
        if has_images:
            features.add("vision")
        if not best_effort:
            guarantees.add("prompt_overflow_refused")
            if forwards_tools and (choice == "required" or named):
                guarantees.add("tool_choice_enforced")
            if rf_type:
                guarantees.add("structured_output_enforced")
        temperature = body.get("temperature")
        spec = _ChatSpec(
            messages=messages,
            tools=tools,
            tool_names=tool_names,
            tool_choice=choice,
            named_function=named,
            forwards_tools=forwards_tools,
            rf_type=rf_type,
            schema=schema,
            schema_strict=schema_strict,
            features=features,
            guarantees=guarantees,
            has_images=has_images,
            temperature=1.0 if temperature is None else float(temperature),
            max_tokens=body.get("max_tokens") or body.get("max_completion_tokens"),
            max_context_length=body.get("max_context_length"),
            model=body.get("model") if isinstance(body.get("model"), str) else None,
            stream=body.get("stream") is True,
        )
        self._store_images(spec)
        self._maybe_offload(spec)
        return spec

    def _assign_chat(self, req: _Req, decl: _Declaration, now: float) -> dict[str, Any]:
        spec = req.chat
        assert spec is not None
        body = req.body
        max_length = spec.max_tokens or int(decl.limits["max_length"])
        max_context = spec.max_context_length or int(decl.limits["max_context_length"])
        job = self._new_job(req, decl, decl.model_id, max_length, now)
        job.stream_progress = spec.stream
        transports = set(decl.image_transports)
        image_transport = "url" if "url" in transports else "base64"
        payload: dict[str, Any] = {}
        if spec.offload_key is not None and "messages_url" in transports:
            payload["messages_url"] = self._sign(spec.offload_key, self.messages_url_s)
        else:
            payload["messages"] = self._inline_images(spec.messages, image_transport)

        def pick(key: str, default: Any) -> Any:
            value = body.get(key)
            return default if value is None else value

        payload["temperature"] = pick("temperature", 1.0)
        payload["top_p"] = pick("top_p", 1.0)
        payload["frequency_penalty"] = pick("frequency_penalty", 0.0)
        payload["presence_penalty"] = pick("presence_penalty", 0.0)
        payload["rep_pen"] = pick("rep_pen", 1.0)
        payload["top_k"] = pick("top_k", 0)
        payload["min_p"] = pick("min_p", 0.0)
        stop = body.get("stop")
        if isinstance(stop, str):
            payload["stop_sequence"] = [stop]
        elif isinstance(stop, list) and stop:
            payload["stop_sequence"] = list(stop)
        if body.get("seed") is not None:
            payload["seed"] = body["seed"]
        if "reasoning_effort" in decl.features:
            payload["reasoning_effort"] = pick("reasoning_effort", "medium")
        payload["max_length"] = max_length
        payload["max_context_length"] = max_context
        payload["n"] = 1
        if spec.forwards_tools:
            if spec.named_function is not None:
                payload["tools"] = [
                    copy.deepcopy(t)
                    for t in spec.tools
                    if t["function"]["name"] == spec.named_function
                ]
                payload["tool_choice"] = "required"
            else:
                payload["tools"] = copy.deepcopy(spec.tools)
                if spec.tool_choice is not None:
                    payload["tool_choice"] = spec.tool_choice
            if body.get("parallel_tool_calls") is not None:
                payload["parallel_tool_calls"] = body["parallel_tool_calls"]
        if spec.rf_type is not None:
            payload["response_format"] = copy.deepcopy(body["response_format"])
        if spec.stream:
            payload["stream_progress"] = True
        return {**_job_answer(job.id, payload, self._ttl_value(), decl.model_id), "chat": True}

    def _chat_reply(self, job: _Job, req: _Req, body: dict[str, Any]) -> dict[str, Any]:
        """Step 6 and "Submit refusals"; raises the refusal as an ``_ApiError``."""
        spec = req.chat
        assert spec is not None

        def invalid(message: str) -> _ApiError:
            return _ApiError(400, "ChatSubmitInvalid", message)

        def nonconformant(message: str) -> _ApiError:
            return _ApiError(400, "ChatSubmitNonconformant", message)

        if "generation" in body and "message" in body:
            raise invalid("A chat submit has message or generation, not both.")
        message = body.get("message")
        if not isinstance(message, dict):
            raise invalid("A chat submit needs message, an assistant message.")
        if message.get("role", "assistant") != "assistant":
            raise invalid("message.role must be assistant.")
        calls = message.get("tool_calls")
        if calls is None:
            calls = []
        if not isinstance(calls, list):
            raise invalid("message.tool_calls must be a list.")
        content = message.get("content")
        if content is None:
            if not calls:
                raise invalid("message.content may be null only beside tool_calls.")
        elif not isinstance(content, str):
            raise invalid("message.content must be a string or null.")
        reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise invalid("message.reasoning_content must be a string.")
            if len(reasoning.encode("utf-8")) > REASONING_MAX_BYTES:
                raise invalid("message.reasoning_content is over 1 MiB.")
        finish = body.get("finish_reason")
        if finish not in FINISH_REASONS:
            raise invalid(f"finish_reason must be one of {', '.join(FINISH_REASONS)}.")
        if finish == "tool_calls" and not calls:
            raise invalid("finish_reason tool_calls needs message.tool_calls.")
        native = body.get("native_finish_reason")
        if native is not None and (
            not isinstance(native, str) or len(native) > NATIVE_FINISH_REASON_MAX_CHARS
        ):
            raise invalid("native_finish_reason must be a string of at most 32 characters.")
        seen: set[str] = set()
        names: list[str] = []
        for i, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(call, dict)
                or not isinstance(call.get("id"), str)
                or not call["id"]
                or call.get("type", "function") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
            ):
                raise invalid(f"message.tool_calls[{i}] needs id, type function and function.name.")
            if not isinstance(fn.get("arguments"), str):
                raise invalid(f"message.tool_calls[{i}].function.arguments must be a string.")
            if fn["name"] not in spec.tool_names:
                raise invalid(
                    f"message.tool_calls[{i}] calls {fn['name']!r}, not a function of the request."
                )
            if call["id"] in seen:
                raise invalid(f"message.tool_calls[{i}].id {call['id']!r} is used twice.")
            seen.add(call["id"])
            names.append(fn["name"])
        if body.get("model_id") != job.model:
            raise _ApiError(
                400,
                "ChatModelMismatch",
                f"model_id {body.get('model_id')!r} is not the assigned model {job.model!r}.",
            )
        counts: dict[str, int | None] = {}
        for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
            value = body.get(key)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_TOKEN_COUNT):
                raise invalid(f"{key} must be an integer from 0 to {MAX_TOKEN_COUNT}.")
            counts[key] = value
        if not req.best_effort:
            choice = spec.tool_choice
            if calls and choice == "none":
                raise nonconformant("The reply calls a tool under tool_choice none.")
            if not calls and spec.forwards_tools and (
                choice == "required" or spec.named_function
            ):
                raise nonconformant("The reply calls no tool under a required tool_choice.")
            if spec.named_function is not None and any(
                n != spec.named_function for n in names
            ):
                raise nonconformant(
                    f"The reply calls another function than {spec.named_function!r}."
                )
            only_calls = bool(calls) and not content
            if spec.rf_type is not None and not only_calls:
                self._check_format(spec, content or "", nonconformant)
        stored = copy.deepcopy(message)
        stored["role"] = "assistant"
        if not req.best_effort and _parallel_off(req.body) and len(calls) > 1:
            stored["tool_calls"] = stored["tool_calls"][:1]
        stored_finish = "stop" if spec.named_function and finish == "tool_calls" else finish
        nbytes = len((content or "").encode()) + len((reasoning or "").encode())
        nbytes += sum(len(c["function"]["arguments"].encode()) for c in calls)
        reward = self._reward(job, nbytes)
        job.action = "submitted"
        self._record(job, "submitted", 200, None, None, body)
        if req.state == "processing":
            req.state = "done"
        req.message = stored
        req.finish_reason = stored_finish
        req.native_finish_reason = native
        req.prompt_tokens = counts["prompt_tokens"]
        req.completion_tokens = counts["completion_tokens"]
        req.reasoning_tokens = counts["reasoning_tokens"]
        req.reward = reward
        return {"reward": reward}

    @staticmethod
    def _check_format(
        spec: _ChatSpec, content: str, nonconformant: Callable[[str], _ApiError]
    ) -> None:
        if spec.rf_type == "json_schema" and spec.schema_strict:
            if _jsonschema is None or spec.schema is None:
                return
            try:
                value = json.loads(content)
            except ValueError as exc:
                raise nonconformant("The content is not JSON, as the json_schema needs.") from exc
            try:
                _jsonschema.validate(value, spec.schema)
            except _jsonschema.ValidationError as exc:
                raise nonconformant(
                    f"The content does not match the json_schema: {exc.message}"
                ) from exc
            except _jsonschema.SchemaError:
                return
            return
        try:
            value = json.loads(content)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise nonconformant(f"The content is not a JSON object, as {spec.rf_type} needs.")
