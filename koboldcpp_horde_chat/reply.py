"""The structured submit and the fault submit (pure; no I/O).

Seed sections: "6. Submit the reply", "Submit refusals", "7. Fault a job".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BackendReply:
    """What koboldcpp returned for one chat generation, whole or streamed.

    Attributes:
        content: the reply text as koboldcpp sent it (may still hold reasoning tags),
            or None when it sent null.
        reasoning_content: reasoning koboldcpp already split off, or None.
        tool_calls: the calls as koboldcpp sent them (list of
            ``{"id", "type", "function": {"name", "arguments"}}``); empty when none.
        native_finish_reason: koboldcpp's ``finish_reason`` (``"stop"``, ``"length"``,
            ``"tool_calls"``, ``"error"``...), or None when it sent none.
        prompt_tokens, completion_tokens: the counts koboldcpp reported, or None.
    """

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    native_finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
