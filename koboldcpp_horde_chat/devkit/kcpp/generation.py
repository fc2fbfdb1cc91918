"""Serving a generation: the model lock and the queue, batching
(``--parallelrequests``), the token budget, timing token by token, the perf figures
and a local user's generation.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from koboldcpp_horde_chat.devkit.kcpp.aborts import Aborts
from koboldcpp_horde_chat.devkit.kcpp.model import (
    _float_or,
    _int_or_none,
    _Outcome,
    _received_images,
)
from koboldcpp_horde_chat.devkit.kcpp.state import _Run
from koboldcpp_horde_chat.devkit.kcpp.values import (
    BAD_INPUT_BODY,
    BUSY_BODY,
    DEFAULT_CHAT_GENLEN,
    DEFAULT_KOBOLD_GENLEN,
    PROMPT_BATCH_TOKENS,
    STOP_EOS,
    STOP_OUT_OF_TOKENS,
    UNAUTHORIZED_BODY,
)
from koboldcpp_horde_chat.devkit.kcpp.wire import _ClientGone, _Exchange


class Generation(Aborts):
    """How every generation route waits, runs (alone or batched) and is counted."""

    @property
    def generating(self) -> bool:
        """True while a generation holds the model lock."""
        return self._model.locked()

    @property
    def queue(self) -> int:
        """Requests waiting for the model lock."""
        return self._queue

    @property
    def running(self) -> int:
        """Generations running now: the one holding the model lock, if any, and the batched ones."""
        with self._lock:
            return len(self._batched_runs) + (1 if self._current_run is not None else 0)

    def local_generate(self, seconds: float, *, genkey: str = "KCPP0001") -> threading.Thread:
        """Simulate a local user's generation holding the model for ``seconds``.

        Runs in a daemon thread (returned, already started): waits for the model
        lock like any request, updates ``last_non_horde_request_time`` at the
        start and the end, and can be aborted like a real generation.
        """

        def work() -> None:
            with self._lock:
                self._queue += 1
            try:
                acquired = self._acquire_model()
            finally:
                with self._lock:
                    self._queue -= 1
            if not acquired:
                return
            try:
                with self._lock:
                    self._last_req_time = time.time()
                run = self._begin(genkey)
                aborted = run.abort.wait(seconds)
                self._finish_stats(0, 0, STOP_OUT_OF_TOKENS if aborted else STOP_EOS)
                self._end(run)
            finally:
                self._model.release()

        thread = threading.Thread(target=work, name="scripted-kcpp-local", daemon=True)
        thread.start()
        return thread

    def _acquire_model(self) -> bool:
        while not self._stopping.is_set():
            if self._model.acquire(timeout=0.05):
                return True
        return False

    def _serve_generation(
        self, ex: _Exchange, serve: Callable[[_Exchange, dict[str, Any], _Run], None]
    ) -> None:
        if self.busy:
            ex.send_json(503, BUSY_BODY)
            return
        with self._lock:
            self._queue += 1
        try:
            acquired = self._acquire_model()
        finally:
            with self._lock:
                self._queue -= 1
        if not acquired:
            ex.reset()
            return
        released = False
        try:
            with self._lock:
                self._last_req_time = time.time()  # koboldcpp sets it before the auth check
            if not self._authorized(ex):
                ex.send_json(401, UNAUTHORIZED_BODY)
                return
            if not isinstance(ex.body, dict):
                ex.send_json(500, BAD_INPUT_BODY)
                return
            genkey = ex.body.get("genkey", "")
            genkey = genkey if isinstance(genkey, str) else ""
            if self._batchable(ex.route, ex.body):
                # koboldcpp releases modelbusy and counts a batched runner (L7116-7122)
                with self._batch_cond:
                    self._batched += 1
                self._model.release()
                released = True
                try:
                    self._serve_batched(ex, serve, genkey)
                finally:
                    with self._batch_cond:
                        self._batched -= 1
                        self._batch_cond.notify_all()
                return
            # a request that is not batchable waits, holding the lock, for the
            # batched ones to end (L7107-7111)
            with self._batch_cond:
                while self._batched > 0 and not self._stopping.is_set():
                    self._batch_cond.wait(0.05)
            run = self._begin(genkey)
            try:
                serve(ex, ex.body, run)
            finally:
                self._end(run)
        finally:
            if not released:
                self._model.release()

    def _serve_batched(
        self,
        ex: _Exchange,
        serve: Callable[[_Exchange, dict[str, Any], _Run], None],
        genkey: str,
    ) -> None:
        """One batched generation, in one of ``parallel_requests`` batch slots."""
        while not self._batch_slots.acquire(timeout=0.05):
            if self._stopping.is_set():
                ex.reset()
                return
        try:
            run = self._begin(genkey, batched=True)
            try:
                serve(ex, cast(dict[str, Any], ex.body), run)
            finally:
                self._end(run)
        finally:
            self._batch_slots.release()

    def _batchable(self, route: str, body: dict[str, Any]) -> bool:
        """koboldcpp's ``continuous_batching_python_eligible`` (L2347-2378) on the body.

        Tools count when a ``tool_choice`` other than ``"none"`` may use them
        (koboldcpp then sets ``using_openai_tools``); a ``response_format`` or
        ``json_schema`` counts as the grammar koboldcpp makes of it.
        """
        if self.parallel_requests <= 1:
            return False
        if body.get("negative_prompt") or body.get("images") or body.get("audio"):
            return False
        received = _received_images(body.get("messages")) if route == "chat" else None
        if received is not None and received["data_urls"]:
            return False
        if any(body.get(key) for key in ("grammar", "grammar_retain_state")):
            return False
        if any(body.get(key) for key in ("banned_tokens", "banned_strings")):
            return False
        if route == "chat":
            fmt = body.get("response_format")
            if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
                return False
            if isinstance(body.get("json_schema"), dict):
                return False
            tools = body.get("tools")
            if isinstance(tools, list) and tools and body.get("tool_choice") != "none":
                return False
        for key in ("dry_multiplier", "mirostat", "xtc_probability", "nsigma"):
            if _float_or(body.get(key), 0.0):
                return False
        if _float_or(body.get("smoothing_factor"), 0.0) or _float_or(
            body.get("adaptive_target"), -1.0
        ) > 0:
            return False
        if _float_or(body.get("top_a"), 0.0) or _float_or(body.get("tfs"), 1.0) != 1:
            return False
        if _float_or(body.get("dynatemp_range"), 0.0):
            return False
        order = body.get("sampler_order")
        if order and order != [6, 0, 1, 3, 4, 2, 5]:
            return False
        return not body.get("reasoning_effort")

    def _process_s(self, prompt_tokens: int) -> float:
        """Seconds of prompt processing of ``prompt_tokens`` tokens."""
        return self.prompt_delay_s + self.prompt_token_delay_s * prompt_tokens

    def _finish_stats(self, prompt_tokens: int, completion_tokens: int, stop_reason: int) -> None:
        eval_time = completion_tokens * self.token_delay_s
        process_time = self._process_s(prompt_tokens)
        with self._lock:
            p = self._perf
            p["last_process_time"] = float(process_time)
            p["last_eval_time"] = float(eval_time)
            p["last_process"] = (
                process_time * 1000.0 / prompt_tokens if prompt_tokens else 0.0
            )
            p["last_eval"] = eval_time * 1000.0 / completion_tokens if completion_tokens else 0.0
            p["last_process_speed"] = (
                prompt_tokens / process_time if process_time > 0 else 0
            )
            p["last_eval_speed"] = completion_tokens / eval_time if eval_time > 0 else 0
            p["last_token_count"] = completion_tokens
            p["last_input_count"] = prompt_tokens
            p["last_seed"] = random.randint(0, 2**31 - 1)
            p["total_gens"] += 1
            p["stop_reason"] = stop_reason

    def _budget(self, body: dict[str, Any], *, chat: bool) -> tuple[int, int]:
        """(max_length, context) after koboldcpp's clamps (1.116.1 ``koboldcpp.py`` L4243-4247).

        As ``generate()`` (L2168-2180): the context capped at the loaded one,
        ``max_length`` capped at ``--genlimit`` when above 0, then a
        ``max_length`` of at least ``ctx - max(min(ctx - 4, 16), int(ctx * 0.2))``
        cut to that value.
        """
        ctx = self.max_context_length
        req_ctx = _int_or_none(body.get("max_context_length"))
        if req_ctx is not None and 0 < req_ctx < ctx:
            ctx = req_ctx
        budget = _int_or_none(body.get("max_length"))
        if chat and (budget is None or budget <= 0):
            budget = _int_or_none(body.get("max_tokens"))
            if budget is None or budget <= 0:
                budget = _int_or_none(body.get("max_completion_tokens"))
            if budget is None or budget <= 0:
                budget = DEFAULT_CHAT_GENLEN
        elif budget is None or budget <= 0:
            budget = DEFAULT_KOBOLD_GENLEN
        if self.genlimit > 0 and budget > self.genlimit:
            budget = self.genlimit
        reserved = max(min(ctx - 4, 16), int(ctx * 0.2))
        if budget >= ctx - reserved:
            budget = ctx - reserved
        return max(1, budget), ctx

    def _process_prompt(
        self, ex: _Exchange, run: _Run, prompt_tokens: int, *, watch: bool
    ) -> bool:
        """Wait out the processing of ``prompt_tokens`` tokens; False when aborted
        or the client left. ``prompt_delay_s`` first, then batch by batch of
        :data:`PROMPT_BATCH_TOKENS` at ``prompt_token_delay_s`` a token, an abort
        heard only between batches (koboldcpp's ``early_abort`` check); a prompt
        over ``hang_prompts_over`` tokens hangs until aborted."""
        if not self._wait(ex, run, self.prompt_delay_s, watch=watch):
            return False
        if self.hang_prompts_over is not None and prompt_tokens > self.hang_prompts_over:
            while self._wait(ex, run, 3600.0, watch=watch):
                pass
            return False
        left = prompt_tokens if self.prompt_token_delay_s > 0 else 0
        while left > 0:
            batch = min(left, PROMPT_BATCH_TOKENS)
            if self._stopping.wait(batch * self.prompt_token_delay_s):
                return False
            left -= batch
            if run.abort.is_set():
                return False
            if watch and ex.client_gone():
                run.abort.set()
                raise _ClientGone()
        return True

    def _run_tokens(
        self, ex: _Exchange, run: _Run, outcome: _Outcome, *, watch: bool, prompt_tokens: int = 0
    ) -> bool:
        """Wait out prompt processing and each token; False when aborted or the client left.

        Trims ``outcome`` to the tokens generated before an abort.
        """
        if not self._process_prompt(ex, run, prompt_tokens, watch=watch):
            outcome.pieces = []
            outcome.stop_reason = STOP_OUT_OF_TOKENS
            outcome.completion_tokens = 0
            return False
        for i, piece in enumerate(outcome.pieces):
            try:
                waited = self._wait(ex, run, self.token_delay_s, watch=watch)
            except _ClientGone:
                outcome.pieces, outcome.completion_tokens = outcome.pieces[:i], i
                raise
            if not waited:
                outcome.pieces = outcome.pieces[:i]
                outcome.stop_reason = STOP_OUT_OF_TOKENS
                outcome.completion_tokens = i
                return False
            run.partial += piece
        return True

    def _wait(self, ex: _Exchange, run: _Run, seconds: float, *, watch: bool) -> bool:
        """Sleep ``seconds``; False when aborted, stopping or (``watch``) the client left."""
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            if run.abort.is_set() or self._stopping.is_set():
                return False
            if watch and ex.client_gone():
                run.abort.set()
                raise _ClientGone()
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            run.abort.wait(min(left, 0.05))
