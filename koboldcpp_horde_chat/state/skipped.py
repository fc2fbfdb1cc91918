"""What an empty pop's ``skipped`` counts say, in the terms of what the worker
declared (pure; no I/O).

The Horde answers a pop that found no job with ``skipped``: per reason, how
many waiting requests its ``can_generate`` passed over for this worker
(``max_length``: the request asks for more tokens than the worker declared for
its kind, text ``max_length`` or chat ``chat_limits.max_length``;
``max_context_length``: a longer context; ``models``: a model the worker does
not serve; others such as ``bridge_version``, ``untrusted`` or ``kudos``).
:func:`describe_skipped` words them with the declared values and why a
``max_length`` is lowered (``lease_fit.LeaseFit.lowered_because``);
:class:`SkippedReporter` says a line once until it changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Seconds at least between two lines about empty pops' ``skipped`` counts.
SKIPPED_EVERY_S = 60.0


@dataclass(frozen=True)
class SkipContext:
    """What the pop that got the ``skipped`` answer declared, for
    :func:`describe_skipped` to say why requests were skipped in those terms.

    Attributes:
        max_length: per kind the pop asked for (``"text"``, ``"chat"``), its
            declared ``max_length`` (text: ``max_length``; chat:
            ``chat_limits.max_length``), tokens.
        max_context_length: per kind, the declared context, tokens.
        models: the models the pop declared.
        lowered: per kind, why its ``max_length`` is below the operator's
            (``lease_fit.LeaseFit.lowered_because``), when it is.
    """

    max_length: Mapping[str, int]
    max_context_length: Mapping[str, int]
    models: tuple[str, ...] = ()
    lowered: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of_pop(cls, body: Mapping[str, Any], lowered: Mapping[str, str]) -> SkipContext:
        """The context of a pop ``body`` (``declaration.pop_body``'s shape)."""
        lengths: dict[str, int] = {}
        contexts: dict[str, int] = {}
        if body.get("prompt_jobs") is not False:
            lengths["text"] = int(body.get("max_length") or 0)
            contexts["text"] = int(body.get("max_context_length") or 0)
        limits = body.get("chat_limits")
        if body.get("chat_jobs") is True and isinstance(limits, Mapping):
            lengths["chat"] = int(limits.get("max_length") or 0)
            contexts["chat"] = int(limits.get("max_context_length") or 0)
        models = body.get("models")
        return cls(
            max_length=lengths,
            max_context_length=contexts,
            models=tuple(map(str, models)) if isinstance(models, list) else (),
            lowered={k: v for k, v in lowered.items() if k in lengths},
        )


def _declared_words(name: str, values: Mapping[str, int], lowered: Mapping[str, str]) -> str:
    """``"the 50 tokens max_length declared for text jobs (lowered: koboldcpp ran
    out of a lease)"``, or per kind when the kinds' values differ."""

    def why(kind: str) -> str:
        return f" (lowered: {lowered[kind]})" if kind in lowered else ""

    kinds = list(values)
    if len(set(values.values())) == 1 and not any(k in lowered for k in kinds):
        value = next(iter(values.values()))
        return f"the {value} tokens {name} declared"
    if len(kinds) == 1:
        kind = kinds[0]
        return f"the {values[kind]} tokens {name} declared for {kind} jobs{why(kind)}"
    each = ", ".join(f"{values[k]} tokens for {k} jobs{why(k)}" for k in kinds)
    return f"the {name} declared for their kind ({each})"


def _skip_reason(name: str, count: int, context: SkipContext | None) -> str:
    """One reason of ``skipped`` in words (the Horde's ``can_generate`` checks)."""
    they = "they ask" if count != 1 else "it asks"
    if context is not None:
        if name == "max_length" and context.max_length:
            words = _declared_words("max_length", context.max_length, context.lowered)
            return f"{they} for more than {words}"
        if name == "max_context_length" and context.max_context_length:
            words = _declared_words("max_context_length", context.max_context_length, {})
            return f"{they} for a longer context than {words}"
        if name == "models" and context.models:
            return f"{they} for other models than {', '.join(context.models)}"
    return f"{name}={count}"


def describe_skipped(skipped: object, context: SkipContext | None = None) -> str | None:
    """``"3 requests skipped: max_context_length=2, models=1"``, or None when none were.

    With the ``context`` of the pop (:class:`SkipContext`), the Horde's reasons
    it can word are said in the operator's terms, with the declared value and
    why it is lowered: ``"2 requests skipped: they ask for more than the 50
    tokens max_length declared for text jobs (lowered: koboldcpp ran out of a
    lease)"``. The Horde counts a request under ``max_length`` when it asks for
    more tokens than the worker declared for its kind (text ``max_length``, chat
    ``chat_limits.max_length``), under ``max_context_length`` for a longer
    context, under ``models`` for models the worker does not serve (its
    ``can_generate``); other reasons are said by their names.

    Args:
        skipped: the pop answer's ``skipped``: a mapping of reason to count,
            e.g. ``{"max_context_length": 2, "models": 1}``.
        context: what the pop declared; None: reasons by their names only.
    """
    if not isinstance(skipped, dict):
        return None
    counts = sorted(
        (str(name)[:40], int(value))
        for name, value in skipped.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    )
    if not counts:
        return None
    total = sum(value for _, value in counts)
    head = f"{total} request{'s' if total != 1 else ''} skipped: "
    if context is None:
        return head + ", ".join(f"{name}={value}" for name, value in counts[:12])
    if len(counts) == 1:
        return head + _skip_reason(counts[0][0], counts[0][1], context)
    parts = []
    for name, value in counts[:12]:
        words = _skip_reason(name, value, context)
        if words.startswith("they ask"):
            words = f"{value} ask" + words[len("they ask"):]
        elif words.startswith("it asks"):
            words = f"{value} asks" + words[len("it asks"):]
        parts.append(words)
    return head + "; ".join(parts)


class SkippedReporter:
    """Says what empty pops' ``skipped`` counts show, once until it changes.

    A line is said when the reasons (the ``skipped`` keys with a count) differ
    from those said last: the same request waiting pop after pop under the
    same reason is said once, whatever its counts do meanwhile. A pop that
    skipped nothing forgets what was said, so a reason that comes back is said
    again. Two lines are at least :data:`SKIPPED_EVERY_S` seconds apart (a
    change within that time is said once it has passed, if it still holds).
    """

    def __init__(self) -> None:
        self._said_at: float | None = None
        self._said: frozenset[str] | None = None

    def line(
        self, skipped: object, now: float, context: SkipContext | None = None
    ) -> str | None:
        """The line to log for an empty pop's ``skipped`` at monotonic ``now``, or
        None; ``context`` is what that pop declared (:func:`describe_skipped`). A
        changed declaration behind the same reasons is a change too."""
        line = describe_skipped(skipped, context)
        if line is None:
            self._said = None
            return None
        assert isinstance(skipped, dict)  # describe_skipped said something
        reasons = frozenset(
            str(name)[:40]
            for name, value in skipped.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        ) | ({repr(context)} if context is not None else set())
        if reasons == self._said:
            return None
        if self._said_at is not None and now - self._said_at < SKIPPED_EVERY_S:
            return None
        self._said_at = now
        self._said = reasons
        return line
