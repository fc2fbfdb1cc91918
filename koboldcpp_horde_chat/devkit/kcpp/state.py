"""One generation's run and :class:`KcppCore`, the state the scripted koboldcpp's
route families share (with the password check they all make).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from koboldcpp_horde_chat.devkit.kcpp.model import ScriptedReply, _Tokenizer
from koboldcpp_horde_chat.devkit.kcpp.values import Fault
from koboldcpp_horde_chat.devkit.kcpp.wire import _Exchange, _Server


@dataclass(eq=False)
class _Run:
    """One generation: the one holding the model lock, or a batched one."""

    genkey: str
    abort: threading.Event = field(default_factory=threading.Event)
    partial: str = ""


class KcppCore:
    """The state every route family of :class:`ScriptedKoboldcpp` shares.

    :meth:`ScriptedKoboldcpp.__init__` sets all of it (see its docstring for the
    public attributes). ``_lock`` guards the state; ``_model`` is koboldcpp's
    ``modelbusy`` lock and ``_batch_cond`` its ``batched_cond``.
    """

    model_name: str
    genlimit: int
    parallel_requests: int
    max_request_bytes: int
    max_context_length: int
    vision: bool
    password: str
    version: str
    jinja: bool
    chat_template: str | None
    token_delay_s: float
    prompt_delay_s: float
    prompt_token_delay_s: float
    hang_prompts_over: int | None
    horde_max_length: int
    horde_max_context_length: int
    abort_reply_delay_s: float
    tokenizer: _Tokenizer
    _host: str
    _port: int
    requests: list[dict[str, Any]]
    aborts: list[str]
    generations: list[dict[str, Any]]
    tokencount_messages: list[dict[str, Any]]
    images: list[dict[str, Any]]
    last_non_horde_request_time: float | None
    busy: bool
    hold_stop_sequences: bool
    log_chunks: bool
    chunk_log: list[tuple[float, dict[str, Any]]]
    _script: Callable[[dict[str, Any]], ScriptedReply | None] | None
    _fail_rule: Callable[[str, Any], Fault | None] | None
    _faults: dict[str, deque[Fault]]
    _lock: threading.Lock
    _model: threading.Lock
    _queue: int
    _current_genkey: str
    _current_run: _Run | None
    _batched_runs: set[_Run]
    _batch_cond: threading.Condition
    _batched: int
    _batch_slots: threading.Semaphore
    _pending_abort: str | None
    _last_text: str
    _stopping: threading.Event
    _server: _Server | None
    _thread: threading.Thread | None
    _started_at: float
    _last_req_time: float
    _perf: dict[str, Any]

    def _authorized(self, ex: _Exchange) -> bool:
        if not self.password:
            return True
        return ex.header("Authorization").strip() == f"Bearer {self.password}"
