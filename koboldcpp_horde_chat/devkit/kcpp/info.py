"""The routes that tell about the instance: the open GETs (versions, model, context
and length limits, models, perf) and the token count.
"""

from __future__ import annotations

import time

from koboldcpp_horde_chat.devkit.kcpp.model import _render_chat
from koboldcpp_horde_chat.devkit.kcpp.state import KcppCore
from koboldcpp_horde_chat.devkit.kcpp.values import (
    BOS_ID,
    KAI_API_VERSION,
    PROTECTED_MODEL_NAME,
    UNAUTHORIZED_BODY,
)
from koboldcpp_horde_chat.devkit.kcpp.wire import _Exchange


class InfoRoutes(KcppCore):
    """Version, model, limits, perf and tokencount routes."""

    def _route_info_version(self, ex: _Exchange) -> None:
        ex.send_json(200, {"result": KAI_API_VERSION})

    def _route_model(self, ex: _Exchange) -> None:
        name = self.model_name if self._authorized(ex) else PROTECTED_MODEL_NAME
        ex.send_json(200, {"result": name})

    def _route_version(self, ex: _Exchange) -> None:
        ex.send_json(
            200,
            {
                "result": "KoboldCpp",
                "version": self.version,
                "protected": bool(self.password),
                "llm": self.model_name != "inactive",
                "txt2img": False,
                "vision": self.vision,
                "audio": False,
                "transcribe": False,
                "multiplayer": False,
                "websearch": False,
                "tts": False,
                "embeddings": False,
                "music": False,
                "savedata": False,
                "admin": 0,
                "router": False,
                "guidance": False,
                "jinja": self.jinja,
                "mcp": False,
            },
        )

    def _route_props(self, ex: _Exchange) -> None:
        # koboldcpp 1.116.1 koboldcpp.py L6316-6335 (routed away when there is no template).
        ex.send_json(
            200,
            {
                "chat_template": self.chat_template,
                "id": 0,
                "id_task": -1,
                "total_slots": 1,
                "modalities": {"vision": self.vision, "audio": False},
                "model_path": self.model_name,
                "n_ctx": self.max_context_length,
                "default_generation_settings": {"n_ctx": self.max_context_length},
            },
        )

    def _route_true_max_context_length(self, ex: _Exchange) -> None:
        ex.send_json(200, {"value": self.max_context_length})

    def _route_max_context_length(self, ex: _Exchange) -> None:
        ctx = self.max_context_length
        horde = self.horde_max_context_length
        ex.send_json(200, {"value": min(ctx, horde if horde > 0 else ctx)})

    def _route_max_length(self, ex: _Exchange) -> None:
        ex.send_json(200, {"value": self.horde_max_length})

    def _route_models(self, ex: _Exchange) -> None:
        ex.send_json(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": int(self._started_at),
                        "owned_by": "koboldcpp",
                        "status": {"value": "loaded"},
                        "permission": [],
                        "root": "koboldcpp",
                    }
                ],
            },
        )

    def _route_perf(self, ex: _Exchange) -> None:
        now = time.time()
        with self._lock:
            body = dict(self._perf)
            body["queue"] = self._queue
            body["idle"] = 0 if self._model.locked() or self._batched_runs else 1
            body["hordeexitcounter"] = -1
            body["uptime"] = now - self._started_at
            body["idletime"] = now - self._last_req_time
            body["quiet"] = True
        ex.send_json(200, body)

    def _route_tokencount(self, ex: _Exchange) -> None:
        if not self._authorized(ex):
            ex.send_json(401, UNAUTHORIZED_BODY)
            return
        body = ex.body if isinstance(ex.body, dict) else {}
        prompt = body.get("prompt", "")
        if prompt is None:
            prompt = ""
        if not isinstance(prompt, str):
            ex.send_json(400, {"value": -1})
            return
        if prompt == "" and "messages" in body:
            self.tokencount_messages.append(body)
            messages = body.get("messages")
            if isinstance(messages, list):
                # adapter mode keeps tools in memory, which tokencount does not count
                # (koboldcpp 1.116.1 koboldcpp.py L6478-6484)
                prompt, _ = _render_chat(messages, None)
        pieces = self.tokenizer.pieces(prompt)
        ids = self.tokenizer.ids(pieces)
        if body.get("special", True) is not False:
            ids = [BOS_ID, *ids]
        ex.send_json(200, {"value": len(ids), "ids": ids, "prompt": prompt})
