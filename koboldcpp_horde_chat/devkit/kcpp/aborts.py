"""Aborts: the generation slot an abort by genkey stops (a batched run is not it),
pending aborts for a queued genkey, and ``generate/check``.
"""

from __future__ import annotations

import time

from koboldcpp_horde_chat.devkit.kcpp.state import KcppCore, _Run
from koboldcpp_horde_chat.devkit.kcpp.values import HORDE_GENKEY_PREFIX, UNAUTHORIZED_BODY
from koboldcpp_horde_chat.devkit.kcpp.wire import _Exchange


class Aborts(KcppCore):
    """The abort and generate/check routes and the start and end of each run."""

    def _route_abort(self, ex: _Exchange) -> None:
        if not self._authorized(ex):
            ex.send_json(401, UNAUTHORIZED_BODY)
            return
        body = ex.body if isinstance(ex.body, dict) else {}
        genkey = body.get("genkey", "")
        genkey = genkey if isinstance(genkey, str) else ""
        with self._lock:
            if (not genkey and self._queue == 0) or (genkey and genkey == self._current_genkey):
                if self._current_run is not None:
                    self._current_run.abort.set()
                self.aborts.append(genkey)
                answer = {"success": "true", "done": "true"}
            elif genkey and self._queue > 0:
                self._pending_abort = genkey
                answer = {"success": "true", "done": "false"}
            else:
                answer = {"success": "false", "done": "false"}
        if self.abort_reply_delay_s > 0:
            self._stopping.wait(self.abort_reply_delay_s)
        ex.send_json(200, answer)

    def _route_generate_check(self, ex: _Exchange) -> None:
        if not self._authorized(ex):
            ex.send_json(401, UNAUTHORIZED_BODY)
            return
        body = ex.body if isinstance(ex.body, dict) else {}
        genkey = body.get("genkey", "") if ex.h.command == "POST" else ""
        with self._lock:
            run = self._current_run
            text = run.partial if run is not None else self._last_text
            if genkey:
                ok = genkey == self._current_genkey
            else:
                ok = (
                    self._queue == 0 and self._perf["total_gens"] > 0 and self._current_genkey == ""
                )
        ex.send_json(200, {"results": [{"text": text if ok else ""}]})

    def _begin(self, genkey: str, *, batched: bool = False) -> _Run:
        """Start a generation. A batched one is not the single slot an abort stops."""
        run = _Run(genkey)
        now = time.time()
        with self._lock:
            if not genkey.startswith(HORDE_GENKEY_PREFIX):
                self.last_non_horde_request_time = now
            self._current_genkey = genkey
            if batched:
                self._batched_runs.add(run)
            else:
                self._current_run = run
            if self._pending_abort is not None and genkey == self._pending_abort:
                self._pending_abort = None
                self.aborts.append(genkey)
                run.abort.set()
        return run

    def _end(self, run: _Run) -> None:
        with self._lock:
            if self._current_run is run:
                self._current_run = None
            self._batched_runs.discard(run)
            self._last_text = run.partial
            if not run.genkey.startswith(HORDE_GENKEY_PREFIX):
                self.last_non_horde_request_time = time.time()
