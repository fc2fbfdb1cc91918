"""A popped job's life, as a pure state machine: its phases and the moves between them.

Seed: "The pop loop" (every popped job ends in one terminal action: an
accepted submit, a fault, or a deliberate no-submit after a cancel or
``ChatJobAborted``) and "7. Fault a job". One table says which move may
follow which phase; :class:`koboldcpp_horde_chat.state.job.JobContext`, the
one owner of a job from the pop's answer to its terminal action, checks every
move through :func:`next_phase`, so the loop, the slots, the pop sent beside
a submit, the stop and the journal cannot disagree about where a job is. The
job driver (``run.driver.JobDriver``) makes the moves, and the submit
pipeline (``run.submit.SubmitPipeline``) the terminal action's.

The phases, in order of a job served in full::

    popped -> journaled -> preparing -> generating -> outcome_ready -> settling -> settled

- ``popped``: the pop's answer carried the job (its id is known);
- ``journaled``: written to the job journal (a SIGKILL from here on leaves
  it there for the next start to fault);
- ``preparing``: offloaded messages, images, the fit check;
- ``generating``: a request to koboldcpp under the job's genkey;
- ``outcome_ready``: the reply (or the fault) to send is known;
- ``settling``: the one terminal action is being sent: granted once, to the
  first caller (:data:`SETTLE`), so a job never gets two;
- ``settled``: the Horde answered it definitively (accepted, refused,
  ``DuplicateGen``, ``AbortedGen``), or the job ended without a submit on
  purpose (cancelled by the client, ended by the Horde, malformed beyond an
  id), or its lease ended with the submit undeliverable;
- ``abandoned``: the process exits with the terminal action unsent; the
  journal keeps the job, and the next start faults it.

A fault may be decided in any phase before ``settling`` (a malformed
payload right after the pop, a failed fetch, a failed generation, the stop's
deadline), so ``settling`` follows every live phase.
"""

from __future__ import annotations

from enum import Enum
from typing import Final


class Phase(str, Enum):
    """Where a popped job is in its life (see the module docstring)."""

    POPPED = "popped"
    JOURNALED = "journaled"
    PREPARING = "preparing"
    GENERATING = "generating"
    OUTCOME_READY = "outcome_ready"
    SETTLING = "settling"
    SETTLED = "settled"
    ABANDONED = "abandoned"


class Move(str, Enum):
    """What happens to a job; each moves it to one phase (see :data:`MOVES`)."""

    JOURNAL = "journal"
    PREPARE = "prepare"
    GENERATE = "generate"
    OUTCOME = "outcome"
    SETTLE = "settle"
    SETTLED = "settled"
    NO_SUBMIT = "no_submit"
    ABANDON = "abandon"


#: The phases a job is still in hand in: it has no definitive end yet.
LIVE: Final = frozenset(
    {Phase.POPPED, Phase.JOURNALED, Phase.PREPARING, Phase.GENERATING, Phase.OUTCOME_READY}
)
#: The phases a job's life ends in.
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
    """A move the table does not allow from the job's phase (a bug, never input)."""


def next_phase(phase: Phase, move: Move) -> Phase:
    """The phase ``move`` leads to from ``phase``.

    Raises:
        IllegalMove: ``move`` may not follow ``phase`` (for example a second
            :data:`Move.SETTLE`: a job gets one terminal action).
    """
    target, sources = MOVES[move]
    if phase not in sources:
        raise IllegalMove(f"{move.value} is not allowed in phase {phase.value}")
    return target


def may(phase: Phase, move: Move) -> bool:
    """True when ``move`` may follow ``phase`` (:func:`next_phase` would not raise)."""
    return phase in MOVES[move][1]
