"""A text job run (seed "8. Keep serving text jobs").

The payload goes to koboldcpp's ``/api/v1/generate`` as koboldcpp's own
worker sends it (with a ``HORDEREQ_`` genkey), and the reply is submitted as
``generation``. A failure raises :class:`~errors.JobFault`. There is nothing
to prepare: the job driver (``run/driver.py``) moves the job to
``generating`` right after :meth:`TextRun.received`.

Its ``max_context_length`` is sent as the job has it, even where koboldcpp's
20 % rule then cuts ``max_length`` (unlike a chat job's): a text prompt is one
raw string that koboldcpp trims to ``context - max_length`` and there is no
fit check, so a larger context would change what the model reads.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import BackendError, JobFault, ReplyError
from ..horde.pop import TextJob
from ..koboldcpp.answers import text_completion_tokens, text_generation
from ..state.job import JobContext, Outcome
from ..state.lease_fit import tokens_of_text
from ..state.ports import Ports
from ..translate.bodies import text_request_body
from ..translate.submits import text_submit

log = logging.getLogger("koboldcpp_horde_chat.text_run")


class TextRun:
    """Serve one text job: :meth:`received`, then :meth:`generate` (the job's
    moves are the driver's, ``run/driver.py``).

    Args:
        ports: the loop's ports (``state.ports.Ports``).
        job: the popped text job.
        ctx: the job in hand.
    """

    def __init__(self, ports: Ports, job: TextJob, ctx: JobContext) -> None:
        self.ports = ports
        self.job = job
        self.ctx = ctx

    def received(self) -> None:
        """Say in one line that the job is served, with its budget."""
        job = self.job
        log.info(
            "job=%s kind=text received: %s tokens, %s context",
            job.id,
            job.payload.get("max_length", "?"),
            job.payload.get("max_context_length", "?"),
        )

    def generate(self, genkey: str) -> Outcome:
        """Generate the job under ``genkey`` (it is ``generating``) and return its
        submit (``{"id", "generation", "state": "ok"}``).

        Raises:
            JobFault: koboldcpp failed or its answer has no text (``backend_failed``).
        """
        job, ctx, kcpp = self.job, self.ctx, self.ports.koboldcpp
        ctx.note_prompt_tokens(text_prompt_tokens(job.payload))
        try:
            body = kcpp.with_busy_retry(
                lambda timeout: kcpp.backend.generate(
                    text_request_body(job, genkey=genkey),
                    timeout_s=timeout,
                    cancel=ctx.abandoned,
                ),
                ctx,
            )
            generation = text_generation(body)
        except (BackendError, ReplyError) as exc:
            raise JobFault(f"generation failed: {exc}", backend_failed=True) from None
        # The reply's length in tokens as koboldcpp counted them, as a chat job's.
        tokens = text_completion_tokens(body)
        detail = f"tokens={'?' if tokens is None else tokens}"
        return Outcome(text_submit(job.id, generation), detail)


def text_prompt_tokens(payload: dict[str, Any]) -> int:
    """The tokens of a text job's prompt that koboldcpp processes, estimated as
    the Horde counts text (``lease_fit.tokens_of_text``), at most what the
    job's context keeps beside its ``max_length`` (koboldcpp cuts the front of
    a longer prompt)."""
    prompt = payload.get("prompt")
    tokens = tokens_of_text(prompt if isinstance(prompt, str) else "")
    context, length = payload.get("max_context_length"), payload.get("max_length")
    if isinstance(context, int) and isinstance(length, int) and context > length >= 0:
        tokens = min(tokens, context - length)
    return tokens
