"""A text job run (seed "8. Keep serving text jobs"): the payload goes to koboldcpp's
``/api/v1/generate`` as koboldcpp's own worker sends it, the reply is submitted
as ``generation``.

Its ``max_context_length`` is sent as the job has it, even where koboldcpp's 20 %
rule then cuts ``max_length`` (unlike a chat job's): koboldcpp trims a text
prompt to ``context - max_length`` and there is no fit check, so a larger
context would change what the model reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..errors import BackendError, JobFault, ReplyError
from ..horde.pop import TextJob
from ..koboldcpp.answers import text_completion_tokens, text_generation
from ..state.job import JobContext, Outcome
from ..state.lease_figures import tokens_of_text
from ..state.ports import Ports
from ..translate.bodies import text_request_body
from ..translate.submits import text_submit

log = logging.getLogger("koboldcpp_horde_chat.text_run")


@dataclass
class TextRun:
    """Serve one text job: :meth:`received`, then :meth:`generate`."""

    ports: Ports
    job: TextJob
    ctx: JobContext

    def received(self) -> None:
        """Say in one line that the job is served, with its budget."""
        job = self.job
        log.info(
            "job=%s kind=text received: %s tokens, %s context",
            job.id, job.payload.get("max_length", "?"), job.payload.get("max_context_length", "?"),
        )

    def generate(self, genkey: str) -> Outcome:
        """Generate under ``genkey``; JobFault (``backend_failed``) when koboldcpp
        failed or its answer has no text."""
        job, ctx, kcpp = self.job, self.ctx, self.ports.koboldcpp
        ctx.note_prompt_tokens(text_prompt_tokens(job.payload))
        try:
            body = kcpp.with_busy_retry(
                lambda timeout: kcpp.backend.generate(
                    text_request_body(job, genkey=genkey), timeout_s=timeout, cancel=ctx.abandoned
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
    """The prompt's tokens koboldcpp processes, estimated as the Horde counts text,
    at most what the context keeps beside ``max_length`` (koboldcpp cuts the rest)."""
    prompt = payload.get("prompt")
    tokens = tokens_of_text(prompt if isinstance(prompt, str) else "")
    context, length = payload.get("max_context_length"), payload.get("max_length")
    if isinstance(context, int) and isinstance(length, int) and context > length >= 0:
        tokens = min(tokens, context - length)
    return tokens
