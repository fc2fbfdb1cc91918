"""What an empty pop's ``skipped`` counts say, in the terms of what the worker
declared (pure). The Horde counts a request under ``max_length`` when it asks
for more tokens than declared for its kind, ``max_context_length`` for a
longer context, ``models`` for a model not served; other reasons are said by
name."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Seconds at least between two lines about empty pops' ``skipped`` counts.
SKIPPED_EVERY_S = 60.0


@dataclass(frozen=True)
class SkipContext:
    """What the pop declared, per kind it asked for, and why a kind's limits are
    lowered (``LeaseFit.lowered_because``)."""

    max_length: Mapping[str, int]
    max_context_length: Mapping[str, int]
    models: tuple[str, ...] = ()
    lowered: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of_pop(cls, body: Mapping[str, Any], lowered: Mapping[str, str]) -> SkipContext:
        # Each kind's limits: the body's own for text, its ``chat_limits`` for chat.
        declared: dict[str, Mapping[str, Any]] = {}
        if body.get("prompt_jobs") is not False:
            declared["text"] = body
        limits = body.get("chat_limits")
        if body.get("chat_jobs") is True and isinstance(limits, Mapping):
            declared["chat"] = limits
        lengths = {k: int(d.get("max_length") or 0) for k, d in declared.items()}
        contexts = {k: int(d.get("max_context_length") or 0) for k, d in declared.items()}
        models = body.get("models")
        return cls(lengths, contexts, tuple(map(str, models)) if isinstance(models, list) else (),
                   {k: v for k, v in lowered.items() if k in lengths})


def _declared_words(name: str, values: Mapping[str, int], lowered: Mapping[str, str]) -> str:

    def why(kind: str) -> str:
        return f" (lowered: {lowered[kind]})" if kind in lowered else ""

    kinds = list(values)
    if len(set(values.values())) == 1 and not any(k in lowered for k in kinds):
        return f"the {values[kinds[0]]} tokens {name} declared"
    if len(kinds) == 1:
        return f"the {values[kinds[0]]} tokens {name} declared for {kinds[0]} jobs{why(kinds[0])}"
    each = ", ".join(f"{values[k]} tokens for {k} jobs{why(k)}" for k in kinds)
    return f"the {name} declared for their kind ({each})"


def _skip_reason(name: str, count: int, context: SkipContext, they: str) -> str:
    if name == "max_length" and context.max_length:
        words = _declared_words("max_length", context.max_length, context.lowered)
        return f"{they} for more than {words}"
    if name == "max_context_length" and context.max_context_length:
        words = _declared_words("max_context_length", context.max_context_length, {})
        return f"{they} for a longer context than {words}"
    if name == "models" and context.models:
        return f"{they} for other models than {', '.join(context.models)}"
    return f"{name}={count}"


def _counts(skipped: object) -> list[tuple[str, int]]:
    if not isinstance(skipped, dict):
        return []
    return sorted(
        (str(name)[:40], int(value))
        for name, value in skipped.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    )


def describe_skipped(skipped: object, context: SkipContext | None = None) -> str | None:
    """``"3 requests skipped: max_context_length=2, models=1"``, or None when none
    were; with the pop's ``context``, in its terms: ``"2 requests skipped: they
    ask for more than the 50 tokens max_length declared for text jobs (lowered:
    koboldcpp ran out of a lease)"``."""
    counts = _counts(skipped)
    if not counts:
        return None
    total = sum(value for _, value in counts)
    head = f"{total} request{'s' if total != 1 else ''} skipped: "
    if context is None:
        return head + ", ".join(f"{name}={value}" for name, value in counts[:12])
    if len(counts) == 1:
        name, value = counts[0]
        return head + _skip_reason(name, value, context, "they ask" if value != 1 else "it asks")
    return head + "; ".join(
        _skip_reason(name, value, context, f"{value} ask" if value != 1 else f"{value} asks")
        for name, value in counts[:12]
    )


class SkippedReporter:
    """Says empty pops' ``skipped`` reasons (or the declaration behind them)
    when they change, whatever their counts do, at most once every
    :data:`SKIPPED_EVERY_S`; a pop that skipped nothing forgets what was said."""

    def __init__(self) -> None:
        self._said_at = -math.inf
        self._said: frozenset[str] | None = None

    def line(self, skipped: object, now: float, context: SkipContext | None = None) -> str | None:
        """The line to log at monotonic ``now``, or None."""
        line = describe_skipped(skipped, context)
        if line is None:
            self._said = None
            return None
        reasons = frozenset(name for name, _ in _counts(skipped)) | {repr(context)}
        if reasons == self._said or now - self._said_at < SKIPPED_EVERY_S:
            return None
        self._said_at, self._said = now, reasons
        return line
