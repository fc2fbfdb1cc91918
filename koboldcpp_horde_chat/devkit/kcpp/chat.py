"""``/v1/chat/completions``: the whole answer, the stream (with the stream faults) and
the tool fake-stream, in koboldcpp's chunk shapes.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from koboldcpp_horde_chat.devkit.kcpp.generation import Generation
from koboldcpp_horde_chat.devkit.kcpp.model import (
    _finish_reason,
    _Outcome,
    _Plan,
    _received_images,
    _stop_list,
    execute_plan,
)
from koboldcpp_horde_chat.devkit.kcpp.output import OaiStreamSplitter, _trim_stops, split_reasoning
from koboldcpp_horde_chat.devkit.kcpp.replies import ScriptedReplies
from koboldcpp_horde_chat.devkit.kcpp.state import _Run
from koboldcpp_horde_chat.devkit.kcpp.values import (
    STOP_CUSTOM,
    STOP_ERROR,
    STOP_INVALID,
    STOP_OUT_OF_TOKENS,
    STREAM_ERROR_EVENT,
)
from koboldcpp_horde_chat.devkit.kcpp.wire import _ClientGone, _Exchange


class ChatCompletions(Generation, ScriptedReplies):
    """The chat completions route, whole and streamed."""

    def _route_chat(self, ex: _Exchange) -> None:
        self._serve_generation(ex, self._chat)

    def _chat(self, ex: _Exchange, body: dict[str, Any], run: _Run) -> None:
        received = _received_images(body.get("messages"))
        if received is not None:
            received["genkey"] = run.genkey
            with self._lock:
                self.images.append(received)
        plan = self._plan_chat(body)
        budget, ctx = self._budget(body, chat=True)
        stops = _stop_list(body.get("stop"))
        prompt_tokens = plan.prompt_tokens
        overflow = prompt_tokens + budget > ctx
        if overflow:
            prompt_tokens = max(1, ctx - budget)
        if run.abort.is_set():  # pre-aborted by a pending abort key
            outcome = _Outcome([], STOP_INVALID, 0)
        else:
            outcome = execute_plan(self.tokenizer, plan.raw, plan.end, budget=budget, stops=stops)
        stream = body.get("stream") is True
        encapsulate = body.get("encapsulate_thinking", True) is not False
        record: dict[str, Any] = {
            "route": "chat",
            "genkey": run.genkey,
            "stream": stream,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "finish_reason": None,
            "aborted": False,
            "client_gone": False,
            "overflow": overflow,
        }
        finish = "length"
        recorded = False
        try:
            if stream and plan.tool_path:
                ex.start_sse()
                record["aborted"] = not self._run_tokens(
                    ex, run, outcome, watch=True, prompt_tokens=prompt_tokens
                )
                message, finish = self._chat_message(plan, outcome, stops, encapsulate)
                self._write_fake_stream(ex, message, finish)
            elif stream:
                self._chat_stream(ex, body, run, outcome, stops, prompt_tokens, encapsulate, record)
                finish = _finish_reason(outcome.stop_reason)
            else:
                record["aborted"] = not self._run_tokens(
                    ex, run, outcome, watch=False, prompt_tokens=prompt_tokens
                )
                message, finish = self._chat_message(plan, outcome, stops, encapsulate)
                # Recorded before the answer leaves, so a client that reads
                # ``generations`` right after the answer always finds it.
                recorded = self._record_generation(record, outcome, finish, prompt_tokens)
                ex.send_json(
                    200,
                    {
                        "id": f"chatcmpl-A{random.randint(100000, 999999)}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": self.model_name,
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": outcome.completion_tokens,
                            "total_tokens": prompt_tokens + outcome.completion_tokens,
                        },
                        "choices": [
                            {
                                "index": 0,
                                "message": message,
                                "finish_reason": finish,
                                "logprobs": None,
                            }
                        ],
                    },
                )
        except _ClientGone:
            record["client_gone"] = True
            record["aborted"] = True
            finish = "length"
            raise
        finally:
            if not recorded:
                self._record_generation(record, outcome, finish, prompt_tokens)

    def _record_generation(
        self, record: dict[str, Any], outcome: _Outcome, finish: str, prompt_tokens: int
    ) -> bool:
        """Finish a generation record, update the perf figures and keep the record."""
        record["completion_tokens"] = outcome.completion_tokens
        record["finish_reason"] = finish
        self._finish_stats(prompt_tokens, outcome.completion_tokens, outcome.stop_reason)
        self.generations.append(record)
        return True

    def _chat_message(
        self, plan: _Plan, outcome: _Outcome, stops: list[str], encapsulate: bool
    ) -> tuple[dict[str, Any], str]:
        """The non-stream ``message`` and ``finish_reason`` (``koboldcpp.py`` L5192-5273)."""
        text = "".join(outcome.pieces)
        if outcome.stop_reason == STOP_CUSTOM:
            text = _trim_stops(text, stops)
        finish = _finish_reason(outcome.stop_reason)
        content, reasoning = split_reasoning(text)
        if plan.tool_path and plan.tool_calls is not None:
            complete = content.strip() == self._tool_json(plan.tool_calls)
            if complete and outcome.stop_reason != STOP_ERROR:
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": None if reasoning else "",
                    "tool_calls": plan.tool_calls,
                }
                if reasoning and encapsulate:
                    message["reasoning_content"] = reasoning
                return message, "tool_calls"
        message = {"role": "assistant", "content": content, "tool_calls": []}
        if reasoning and encapsulate:
            message["reasoning_content"] = reasoning
        elif reasoning:
            message["content"] = reasoning + content
        return message, finish

    def _chunk(self, chunk_id: str, delta: dict[str, Any], finish: str | None) -> bytes:
        event = {
            "id": chunk_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "finish_reason": finish, "delta": delta}],
        }
        return b"data: " + json.dumps(event).encode("utf-8") + b"\n\n"

    def _chat_stream(
        self,
        ex: _Exchange,
        body: dict[str, Any],
        run: _Run,
        outcome: _Outcome,
        stops: list[str],
        prompt_tokens: int,
        encapsulate: bool,
        record: dict[str, Any],
    ) -> None:
        chunk_id = f"chatcmpl-A{random.randint(100000, 999999)}"
        splitter = OaiStreamSplitter(
            stops if self.hold_stop_sequences else [], encapsulate_thinking=encapsulate
        )
        ex.start_sse()
        half = max(1, len(outcome.pieces) // 2)
        cut_after = half if ex.cut is not None else -1
        fault = ex.stream_fault or ""
        error_after = half if fault == "stream_error" else -1
        stall_after = half if fault.startswith("stall:") else -1
        if not self._process_prompt(ex, run, prompt_tokens, watch=True):
            outcome.pieces, outcome.completion_tokens = [], 0
            outcome.stop_reason = STOP_OUT_OF_TOKENS
            record["aborted"] = True
        sent = 0
        try:
            for piece in list(outcome.pieces):
                if record["aborted"]:
                    break
                if not self._wait(ex, run, self.token_delay_s, watch=True):
                    outcome.stop_reason = STOP_OUT_OF_TOKENS
                    record["aborted"] = True
                    break
                run.partial += piece
                sent += 1
                for delta, finish in splitter.step(piece):
                    self._log_chunk(delta)
                    ex.write(self._chunk(chunk_id, delta, finish))
                if sent == error_after:
                    ex.write(b"data: " + json.dumps(STREAM_ERROR_EVENT).encode("utf-8") + b"\n\n")
                    record["error_sent"] = True
                if sent == stall_after and not self._wait(ex, run, float(fault[6:]), watch=True):
                    outcome.stop_reason = STOP_OUT_OF_TOKENS
                    record["aborted"] = True
                    break
                if sent == cut_after:
                    partial = self._chunk(chunk_id, {"role": "assistant", "content": "x"}, None)
                    ex.write(partial[: len(partial) // 2])
                    record["cut"] = True
                    raise _ClientGone()
        finally:
            if sent < len(outcome.pieces):
                outcome.pieces, outcome.completion_tokens = outcome.pieces[:sent], sent
        reason = _finish_reason(outcome.stop_reason)
        for delta, finish in splitter.finish(None if fault == "no_finish" else reason):
            self._log_chunk(delta)
            ex.write(self._chunk(chunk_id, delta, finish))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            completion = len(outcome.pieces)
            usage_event = {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                },
            }
            ex.write(b"data: " + json.dumps(usage_event).encode("utf-8") + b"\n\n")
        ex.write(b"data: [DONE]\n\n")

    def _log_chunk(self, delta: dict[str, Any]) -> None:
        if self.log_chunks:
            self.chunk_log.append((time.monotonic(), dict(delta)))

    def _write_fake_stream(self, ex: _Exchange, message: dict[str, Any], finish: str) -> None:
        """koboldcpp's tool fake-stream: whole reply after generation, id "koboldcpp"."""
        chunks: list[bytes] = []
        if message.get("reasoning_content"):
            chunks.append(
                self._chunk("koboldcpp", {"reasoning_content": message["reasoning_content"]}, None)
            )
        if message.get("content"):
            chunks.append(self._chunk("koboldcpp", {"content": message["content"]}, None))
        calls = message.get("tool_calls") or []
        for index, call in enumerate(calls):
            head = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            chunks.append(self._chunk("koboldcpp", {"tool_calls": [head]}, None))
        for index, call in enumerate(calls):
            args = {"index": index, "function": {"arguments": call["function"]["arguments"]}}
            chunks.append(self._chunk("koboldcpp", {"tool_calls": [args]}, None))
        chunks.append(self._chunk("koboldcpp", {}, finish))
        if ex.cut is not None:
            data = b"".join(chunks)
            ex.write(data[: len(data) // 2])
            raise _ClientGone()
        for chunk in chunks:
            ex.write(chunk)
        ex.write(b"data: [DONE]\n\n")
