"""A popped job's life as a pure state machine: its phases and the moves
between them (seed "The pop loop": every popped job ends in one terminal
action). ``state.job.JobContext`` checks every move through
:func:`next_phase`, so nothing can disagree about where a job is::

    popped -> journaled -> preparing -> generating -> outcome_ready -> settling -> settled

``settling`` (the one terminal action being sent) follows every live phase,
since a fault may be decided anywhere, and is granted once. ``settled``: the
Horde answered it, or the job ended without a submit on purpose, or its lease
ended with the submit undeliverable. ``abandoned``: the process exits with the
terminal action unsent; the journal keeps the job for the next start.
"""

from __future__ import annotations

from enum import Enum
from typing import Final


class Phase(str, Enum):

    POPPED = "popped"
    JOURNALED = "journaled"
    PREPARING = "preparing"
    GENERATING = "generating"
    OUTCOME_READY = "outcome_ready"
    SETTLING = "settling"
    SETTLED = "settled"
    ABANDONED = "abandoned"


class Move(str, Enum):

    JOURNAL = "journal"
    PREPARE = "prepare"
    GENERATE = "generate"
    OUTCOME = "outcome"
    SETTLE = "settle"
    SETTLED = "settled"
    NO_SUBMIT = "no_submit"
    ABANDON = "abandon"


LIVE: Final = frozenset(
    {Phase.POPPED, Phase.JOURNALED, Phase.PREPARING, Phase.GENERATING, Phase.OUTCOME_READY}
)
ENDED: Final = frozenset({Phase.SETTLED, Phase.ABANDONED})

#: Each move: the phase it leads to and the phases it may start from.
MOVES: Final[dict[Move, tuple[Phase, frozenset[Phase]]]] = {
    Move.JOURNAL: (Phase.JOURNALED, frozenset({Phase.POPPED})),
    Move.PREPARE: (Phase.PREPARING, frozenset({Phase.JOURNALED})),
    Move.GENERATE: (Phase.GENERATING, frozenset({Phase.JOURNALED, Phase.PREPARING})),
    Move.OUTCOME: (Phase.OUTCOME_READY, frozenset({Phase.GENERATING})),
    # The one terminal action: from any live phase (a fault can be decided anywhere).
    Move.SETTLE: (Phase.SETTLING, LIVE),
    Move.SETTLED: (Phase.SETTLED, frozenset({Phase.SETTLING})),
    # Ended without a submit on purpose: a cancel, ChatJobAborted, no usable payload.
    Move.NO_SUBMIT: (Phase.SETTLED, LIVE),
    # The process exits with the job unsent (the journal keeps it).
    Move.ABANDON: (Phase.ABANDONED, LIVE | {Phase.SETTLING}),
}


class IllegalMove(ValueError):
    """A move the table does not allow (a bug, never input)."""


def next_phase(phase: Phase, move: Move) -> Phase:
    """The phase ``move`` leads to from ``phase``.

    Raises:
        IllegalMove: ``move`` may not follow ``phase`` (e.g. a second ``SETTLE``).
    """
    target, sources = MOVES[move]
    if phase not in sources:
        raise IllegalMove(f"{move.value} is not allowed in phase {phase.value}")
    return target
