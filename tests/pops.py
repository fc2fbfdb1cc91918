"""Pop responses in the seed's shape, for the tests of the loop and of pop parsing.

Seed 000 "One chat job in full": a chat job's pop carries ``payload`` (the
messages, the samplers, ``max_length``, ``max_context_length``, ``n``), ``id``
and ``ids``, the Horde's ``messages``, ``ttl``, ``skipped``, ``model`` and
``chat: true``.
"""

from __future__ import annotations

from typing import Any


def chat_pop(job_id: str, model: str, *, full: bool = False, **payload: Any) -> dict[str, Any]:
    """A chat job's pop response: ``{"payload": {...}, "id": job_id, ...}``.

    The payload is one user message ("Name one colour."), temperature 1.0,
    the neutral samplers (top_p 1.0, penalties 0.0, rep_pen 1.0, top_k 0,
    min_p 0.0), ``max_length`` 64, ``max_context_length`` 2048 and ``n`` 1,
    updated with ``payload`` (a value of ``...`` removes the key). ``ttl`` is
    150 s. ``full`` adds the keys the seed's example carries with no value
    (``extra_source_images`` and ``softprompt``: None).
    """
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Name one colour."}],
        "temperature": 1.0,
        "top_p": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "rep_pen": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_length": 64,
        "max_context_length": 2048,
        "n": 1,
    }
    for key, value in payload.items():
        if value is ...:
            body.pop(key, None)
        else:
            body[key] = value
    pop: dict[str, Any] = {
        "payload": body,
        "id": job_id,
        "ids": [job_id],
        "messages": [],
        "ttl": 150,
        "skipped": {},
        "model": model,
        "chat": True,
    }
    if full:
        pop["extra_source_images"] = None
        pop["softprompt"] = None
    return pop


def text_pop(job_id: str, model: str, prompt: str = "Once") -> dict[str, Any]:
    """A text job's pop response: ``prompt``, ``max_length`` 40, ``max_context_length``
    1024, ``ttl`` 150 s."""
    return {
        "payload": {"prompt": prompt, "max_length": 40, "max_context_length": 1024},
        "id": job_id,
        "ids": [job_id],
        "ttl": 150,
        "model": model,
    }
