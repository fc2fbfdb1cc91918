"""The pop's declaration checks (step 1) and which requests a declaration may take
(steps 1, 4 and 5), with the skip reasons of the pop's ``skipped`` answer.
"""

from __future__ import annotations

from typing import Any

from koboldcpp_horde_chat.devkit.horde.helpers import (
    _ApiError,
    _invalid_input,
    _is_int,
    _is_number,
    _sanitize,
)
from koboldcpp_horde_chat.devkit.horde.state import _Declaration, _Req
from koboldcpp_horde_chat.devkit.horde.values import (
    BRIDGE_AGENT_MAX_CHARS,
    CHAT_FEATURES,
    DEFAULT_BRIDGE_AGENT,
    IMAGE_TRANSPORTS,
    TEXT_DEFAULT_MAX_CONTEXT,
    TEXT_DEFAULT_MAX_LENGTH,
    WORKER_NAME_MAX_CHARS,
)


class Eligibility:
    """Declaration checks and eligibility rules (no state of their own)."""

    def _declaration(self, body: dict[str, Any]) -> _Declaration:
        """Step 1 "Declaration checks and withdrawal"; raises 400 ChatDeclarationInvalid."""

        def invalid(message: str) -> _ApiError:
            return _ApiError(400, "ChatDeclarationInvalid", message)

        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise _ApiError(400, "BadRequest", "name is required.")
        if len(name) > WORKER_NAME_MAX_CHARS:
            raise _ApiError(
                400,
                "TooLongWorkerName",
                f"The worker name is {len(name)} characters long; the Horde takes at "
                f"most {WORKER_NAME_MAX_CHARS}.",
            )
        models = body.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise _ApiError(400, "BadRequest", "models must be a list of model names.")
        for key in ("max_length", "max_context_length"):
            value = body.get(key)
            if value is not None and (not _is_int(value) or value < 1):
                raise _ApiError(400, "BadRequest", f"{key} must be a positive integer.")
        agent = body.get("bridge_agent")
        if agent is None:
            agent = DEFAULT_BRIDGE_AGENT
        if not isinstance(agent, str):
            raise _invalid_input("bridge_agent", f"{agent!r} is not of type 'string'")
        if len(agent) > BRIDGE_AGENT_MAX_CHARS:
            raise _invalid_input(
                "bridge_agent", f"longer than {BRIDGE_AGENT_MAX_CHARS} characters"
            )
        chat_routes = getattr(self, "chat_routes", True)
        # A Horde without the chat routes knows none of the chat keys and ignores
        # them without a word, prompt_jobs: false included (text jobs still come).
        chat_jobs = chat_routes and body.get("chat_jobs") is True
        prompt_jobs = not chat_routes or body.get("prompt_jobs", True) is not False
        if not prompt_jobs and not chat_jobs:
            raise invalid("prompt_jobs: false needs chat_jobs: true.")
        decl = _Declaration(
            name=name,
            models=list(models),
            max_length=int(body.get("max_length") or TEXT_DEFAULT_MAX_LENGTH),
            max_context_length=int(body.get("max_context_length") or TEXT_DEFAULT_MAX_CONTEXT),
            prompt_jobs=prompt_jobs,
            chat_jobs=chat_jobs,
            bridge_agent=_sanitize(agent),
        )
        if not chat_jobs:
            return decl
        limits = body.get("chat_limits")
        if not isinstance(limits, dict):
            raise invalid("chat_limits is required when chat_jobs is true.")
        for key in ("max_context_length", "max_length"):
            value = limits.get(key)
            if not _is_int(value) or value < 1:
                raise invalid(f"chat_limits.{key} must be a positive integer.")
        tmax = limits.get("tools_max_temperature")
        if tmax is not None and (not _is_number(tmax) or tmax < 0):
            raise invalid("chat_limits.tools_max_temperature must not be negative.")
        model_id = body.get("model_id")
        if not isinstance(model_id, str) or not model_id:
            raise invalid("model_id is required when chat_jobs is true.")
        if model_id not in models:
            raise invalid(f"model_id {model_id!r} must be one of models.")
        features = body.get("chat_features") or []
        transports = body.get("image_transports") or []
        if not isinstance(features, list) or not isinstance(transports, list):
            raise invalid("chat_features and image_transports must be lists.")
        decl.features = [f for f in features if f in CHAT_FEATURES]
        decl.limits = {
            k: limits[k]
            for k in ("max_context_length", "max_length", "tools_max_temperature")
            if k in limits
        }
        decl.model_id = model_id
        decl.image_transports = [t for t in transports if t in IMAGE_TRANSPORTS]
        return decl

    # Skip reasons, by the names of the Horde's pop answer (``skipped``): the first
    # rule a request fails is counted. Rules without such a name are not counted.

    def _text_eligible(self, req: _Req, decl: _Declaration) -> tuple[str | None, str | None]:
        """``(model, None)`` when this worker can take the text request, else
        ``(None, skip reason or None)``."""
        if not decl.prompt_jobs:
            return None, None
        if req.models:
            model = next((m for m in decl.models if m in req.models), None)
        else:
            model = decl.models[0] if decl.models else None
        if model is None:
            return None, "models"
        if req.max_context_length > decl.max_context_length:
            return None, "max_context_length"
        if req.max_length > decl.max_length:
            return None, "max_length"
        if req.validated_backends and not decl.validated:
            return None, "bridge_version"
        return model, None

    def _chat_eligible(self, req: _Req, decl: _Declaration) -> tuple[bool, str | None]:
        """``(True, None)`` when this worker can take the chat request, else
        ``(False, skip reason or None)``."""
        spec = req.chat
        assert spec is not None
        if not decl.chat_jobs or decl.model_id is None:
            return False, None
        if spec.model is not None and spec.model != decl.model_id:
            return False, "models"
        if (
            spec.max_context_length is not None
            and spec.max_context_length > decl.limits["max_context_length"]
        ):
            return False, "max_context_length"
        if spec.max_tokens is not None and spec.max_tokens > decl.limits["max_length"]:
            return False, "max_length"
        if req.validated_backends and not decl.validated:
            return False, "bridge_version"
        declared = set(decl.features)
        if not spec.features <= declared:
            return False, None
        if not req.best_effort and not spec.guarantees <= declared:
            return False, None
        if spec.has_images and not ({"url", "base64"} & set(decl.image_transports)):
            return False, None
        tmax = decl.limits.get("tools_max_temperature")
        if spec.forwards_tools and tmax is not None and spec.temperature > tmax:
            return False, None
        return True, None
