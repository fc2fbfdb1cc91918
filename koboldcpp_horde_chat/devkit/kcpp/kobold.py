"""The Kobold API generation routes: ``/api/v1/generate`` and
``/api/extra/generate/stream``.
"""

from __future__ import annotations

import json
from typing import Any

from koboldcpp_horde_chat.devkit.kcpp.generation import Generation
from koboldcpp_horde_chat.devkit.kcpp.model import (
    _finish_reason,
    _Outcome,
    _Plan,
    _stop_list,
    execute_plan,
)
from koboldcpp_horde_chat.devkit.kcpp.output import _trim_stops
from koboldcpp_horde_chat.devkit.kcpp.replies import ScriptedReplies
from koboldcpp_horde_chat.devkit.kcpp.state import _Run
from koboldcpp_horde_chat.devkit.kcpp.values import STOP_CUSTOM, STOP_INVALID, STOP_OUT_OF_TOKENS
from koboldcpp_horde_chat.devkit.kcpp.wire import _ClientGone, _Exchange


class KoboldGenerate(Generation, ScriptedReplies):
    """The Kobold API's generate and generate/stream routes."""

    def _route_generate(self, ex: _Exchange) -> None:
        self._serve_generation(ex, self._kobold_generate)

    def _route_generate_stream(self, ex: _Exchange) -> None:
        self._serve_generation(ex, self._kobold_stream)

    def _kobold_outcome(
        self, body: dict[str, Any], run: _Run
    ) -> tuple[_Plan, _Outcome, list[str], int, bool]:
        plan = self._plan_kobold(body)
        budget, ctx = self._budget(body, chat=False)
        stops = _stop_list(body.get("stop_sequence"))
        prompt_tokens = plan.prompt_tokens
        overflow = prompt_tokens + budget > ctx
        if overflow:
            prompt_tokens = max(1, ctx - budget)
        if run.abort.is_set():
            outcome = _Outcome([], STOP_INVALID, 0)
        else:
            outcome = execute_plan(self.tokenizer, plan.raw, plan.end, budget=budget, stops=stops)
        return plan, outcome, stops, prompt_tokens, overflow

    def _kobold_generate(self, ex: _Exchange, body: dict[str, Any], run: _Run) -> None:
        _, outcome, stops, prompt_tokens, overflow = self._kobold_outcome(body, run)
        aborted = not self._run_tokens(ex, run, outcome, watch=False, prompt_tokens=prompt_tokens)
        text = "".join(outcome.pieces)
        if outcome.stop_reason == STOP_CUSTOM and body.get("trim_stop", True) is not False:
            text = _trim_stops(text, stops)
        finish = _finish_reason(outcome.stop_reason)
        self._finish_stats(prompt_tokens, outcome.completion_tokens, outcome.stop_reason)
        self.generations.append(
            {
                "route": "generate",
                "genkey": run.genkey,
                "stream": False,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": outcome.completion_tokens,
                "finish_reason": finish,
                "aborted": aborted,
                "client_gone": False,
                "overflow": overflow,
            }
        )
        ex.send_json(
            200,
            {
                "results": [
                    {
                        "text": text,
                        "tool_calls": [],
                        "finish_reason": finish,
                        "logprobs": None,
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": outcome.completion_tokens,
                    }
                ]
            },
        )

    def _kobold_stream(self, ex: _Exchange, body: dict[str, Any], run: _Run) -> None:
        _, outcome, stops, prompt_tokens, overflow = self._kobold_outcome(body, run)
        ex.start_sse()
        record: dict[str, Any] = {
            "route": "generate_stream",
            "genkey": run.genkey,
            "stream": True,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "finish_reason": "length",
            "aborted": False,
            "client_gone": False,
            "overflow": overflow,
        }
        try:
            text = "".join(outcome.pieces)
            if outcome.stop_reason == STOP_CUSTOM:
                text = _trim_stops(text, stops)
            emitted = 0
            if not self._process_prompt(ex, run, prompt_tokens, watch=True):
                record["aborted"] = True
            for i, piece in enumerate(list(outcome.pieces)):
                if record["aborted"]:
                    break
                if not self._wait(ex, run, self.token_delay_s, watch=True):
                    outcome.pieces, outcome.completion_tokens = outcome.pieces[:i], i
                    outcome.stop_reason = STOP_OUT_OF_TOKENS
                    record["aborted"] = True
                    break
                run.partial += piece
                token = text[emitted : emitted + len(piece)]
                emitted += len(token)
                if token:
                    event = json.dumps({"token": token, "finish_reason": None})
                    ex.write(f"event: message\ndata: {event}\n\n".encode())
            finish = _finish_reason(outcome.stop_reason)
            record["finish_reason"] = finish
            event = json.dumps({"token": "", "finish_reason": finish})
            ex.write(f"event: message\ndata: {event}\n\n".encode())
        except _ClientGone:
            record["client_gone"] = record["aborted"] = True
            raise
        finally:
            record["completion_tokens"] = outcome.completion_tokens
            self._finish_stats(prompt_tokens, outcome.completion_tokens, outcome.stop_reason)
            self.generations.append(record)
