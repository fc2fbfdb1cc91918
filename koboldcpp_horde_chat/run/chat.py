"""A chat job run, the seed's steps in order: the conversation (inline, or the
offloaded ``messages_url``), its images made checked data URLs (step 5, seed
004), the fit check (step 3: counting JSON, never rendering), the generation
through ``/v1/chat/completions`` (whole, or streamed as progress posts), and
the structured reply (step 6). A step that cannot serve the job raises
``JobFault``; a cancel raises ``JobEnded``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..errors import BackendError, FetchError, JobFault, PayloadError, ReplyError
from ..horde.declaration import BackendCapabilities
from ..horde.pop import ChatJob, validate_messages
from ..jsonbody import encode_json
from ..koboldcpp.answers import (
    BackendReply,
    aborted_short,
    needs_stop_reason,
    parse_chat_completion,
)
from ..settings import MIB, kcpp_context_keeping_budget, kcpp_effective_max_length
from ..state.job import SUBMIT_MARGIN_S, JobContext, Outcome, payload_keys
from ..state.ports import Ports
from ..state.shared import WorkerState
from ..translate import fit, images
from ..translate.bodies import chat_request_body
from ..translate.submits import FAULT_PROMPT_OVERFLOW, chat_submit
from .downloads import Downloads, fetch_image, fetch_messages
from .streaming import generate_streamed

log = logging.getLogger("koboldcpp_horde_chat.chat_run")

#: Image URLs fetched at once for one job (seed 004: url transport).
IMAGE_FETCH_THREADS = 4
#: The longest a ``messages_url`` fetch may take, seconds (the URL lives 120 s).
MESSAGES_FETCH_MAX_S = 120.0
#: The longest a tokencount or the image fetches may take, seconds.
PREPARE_MAX_S = 60.0
#: Read timeout of the ``/api/extra/perf`` look that tells an abort from a stop sequence.
ABORT_CHECK_TIMEOUT_S = 2.0


@dataclass
class ChatRun:
    """Serve one chat job: :meth:`prepare`, then :meth:`generate`."""

    ports: Ports
    caps: BackendCapabilities
    state: WorkerState
    job: ChatJob
    ctx: JobContext
    messages: list[dict[str, Any]] = field(default_factory=list)

    def received(self) -> None:
        """Say in one line that the job is served, with its budget and whether it streams."""
        job = self.job
        log.info(
            "job=%s kind=chat received: max_length=%d max_context_length=%d stream=%s",
            job.id, job.max_length, job.max_context_length, job.stream_progress,
        )
        log.debug("job=%s payload keys: %s", job.id, payload_keys(job.payload))

    def prepare(self) -> None:
        """The conversation, its images, the budget and the fit check (``messages``
        then holds what to generate from). JobFault: the job cannot be served."""
        messages = self._messages()
        if fit.count_images(messages):
            messages = self._images(messages)
        # The Horde validates budgets within chat_limits (seed step 2): a larger
        # one is not ours to generate, and not a prompt overflow either.
        declared = self.ports.settings.declared_max_length
        if self.job.max_length > declared:
            raise JobFault(
                f"max_length {self.job.max_length} is above the declared chat_limits.max_length "
                f"{declared}"
            )
        self._check_fit(messages)
        self.messages = messages

    def _prepare_timeout(self, cap_s: float) -> float:
        """A step's timeout: at most ``cap_s``, leaving the submit margin to the fault."""
        room = self.ctx.lease.remaining(self.ports.clock.monotonic()) - SUBMIT_MARGIN_S
        return max(1.0, min(cap_s, room))

    def _messages(self) -> list[dict[str, Any]]:
        """The conversation, fetched when offloaded (seed "Fetch offloaded messages")."""
        job = self.job
        if job.messages is not None:
            return job.messages  # inline: validated with the payload (horde.pop)
        assert job.messages_url is not None
        url, timeout = job.messages_url, self._prepare_timeout(MESSAGES_FETCH_MAX_S)
        try:
            raw = self.ctx.until_given_up(partial(
                fetch_messages, url, timeout_s=timeout,
                max_bytes=self.ports.settings.messages_max_bytes,
            ))
        except FetchError as exc:
            raise JobFault(f"messages_url fetch failed: {exc}") from None
        try:
            return validate_messages(raw, job_id=job.id)
        except PayloadError as exc:
            raise JobFault(f"malformed messages at {exc.path}") from None

    def _images(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every image as a checked data URL (its media type from its bytes); one
        koboldcpp cannot decode faults the job instead of being left out."""
        if not self.caps.vision:
            raise JobFault("images sent to a worker without vision")
        timeout = self._prepare_timeout(PREPARE_MAX_S)
        plan = images.plan_images(messages)
        downloads = Downloads()
        try:
            fetched = {}
            if plan.to_fetch:
                fetched = self.ctx.until_given_up(partial(_fetch_images, plan, timeout, downloads))
            return images.finish_images(messages, plan, fetched)
        except FetchError as exc:
            raise JobFault(f"image unusable: {exc}") from None
        finally:
            # Given up (the stop's deadline) or one fetch failed: the ones still
            # under way end now, not by their budget (their threads hold the exit).
            downloads.hang_up()

    def _check_fit(self, messages: list[dict[str, Any]]) -> None:
        """Seed step 3: count the JSON of messages, tools and response_format; never render."""
        job, payload = self.job, self.job.payload
        prompt = fit.fit_prompt(messages, payload.get("tools"), payload.get("response_format"))
        # The fault that follows a failure must still land within the lease.
        timeout = self._prepare_timeout(PREPARE_MAX_S)
        backend = self.ports.koboldcpp.backend
        try:
            counted = self.ctx.until_given_up(lambda: backend.tokencount(prompt, timeout_s=timeout))
        except BackendError as exc:
            raise JobFault(f"tokencount failed: {exc}", backend_failed=True) from None
        limit = min(job.max_context_length, self.ports.settings.max_context_length)
        result = fit.check_fit(
            counted, messages, max_length=job.max_length, max_context_length=limit
        )
        self.ctx.note_prompt_tokens(result.estimate)
        if not result.fits:
            raise JobFault(
                f"does not fit: estimate {result.estimate} + max_length {job.max_length} "
                f"> {limit}",
                fault_reason=FAULT_PROMPT_OVERFLOW,
            )

    def generate(self, genkey: str) -> Outcome:
        """Generate under ``genkey`` and build the structured submit. koboldcpp is
        sent a context that cuts none of ``max_length`` (its 20 % rule), so the
        reply's budget is ``max_length`` capped by ``--genlimit``.

        Raises:
            JobFault: failed or given up (``backend_failed`` when koboldcpp failed).
            JobEnded: the client cancelled it or the Horde ended it.
        """
        job, ctx, ports = self.job, self.ctx, self.ports
        kcpp, settings = ports.koboldcpp, ports.settings
        stream = job.stream_progress and not job.has_tools
        kcpp_context = settings.backend_max_context_length
        sent_context = kcpp_context_keeping_budget(
            job.max_length, job.max_context_length, kcpp_context
        )
        backend_body = encode_json(chat_request_body(
            job, self.messages, genkey=genkey, stream=stream, max_context_length=sent_context
        ))
        limit = settings.kcpp_max_request_bytes
        if len(backend_body) > limit:
            # koboldcpp would answer 500 "Payload is too big" (its --maxrequestsize).
            raise JobFault(
                f"the chat request is {len(backend_body)} bytes, over koboldcpp's "
                f"--maxrequestsize of {limit} bytes ({limit / MIB:g} MiB): not sent "
                "(start koboldcpp with a larger --maxrequestsize to serve such jobs)"
            )
        try:
            if stream:
                with kcpp.own_request():
                    backend_reply = generate_streamed(ports, job, ctx, backend_body)
            else:
                body = kcpp.with_busy_retry(
                    lambda timeout: kcpp.backend.chat_completion(
                        backend_body, timeout_s=timeout, cancel=ctx.abandoned
                    ),
                    ctx,
                )
                backend_reply = parse_chat_completion(body)
            # Given up while the generation ended (the stop's abort): say so, not
            # "aborted on koboldcpp".
            ctx.check_abandoned()
            # koboldcpp cuts a budget near its context and at its --genlimit
            # (settings.kcpp_effective_max_length): "length" means the budget it
            # really used ran out.
            budget = kcpp_effective_max_length(
                job.max_length, sent_context, kcpp_context, settings.kcpp_genlimit
            )
            self._check_not_aborted(backend_reply, budget)
            submit_body = chat_submit(job.id, ctx.model_id, backend_reply, max_length=budget)
        except (BackendError, ReplyError) as exc:
            # Given up meanwhile (the stop hangs up a stream, which then ends cut
            # short): the fault names the stop, not koboldcpp.
            ctx.check_abandoned()
            if isinstance(exc, BackendError) and exc.status == 404:
                # koboldcpp answers 404 only for a POST route it lacks (1.116.1 L7540).
                self.state.chat_route_missing()
            feature = exc.feature if isinstance(exc, ReplyError) else None
            if feature is not None and feature in ctx.declared_features:
                # koboldcpp answered; the model's use of the feature is unusable.
                self.state.record_feature_failure([feature], ports.clock.monotonic())
                raise JobFault(f"generation failed: {exc}", feature=feature) from None
            raise JobFault(f"generation failed: {exc}", backend_failed=True) from None
        calls = len(submit_body["message"].get("tool_calls", []))
        detail = (
            f"finish={submit_body['finish_reason']} "
            f"tokens={submit_body.get('completion_tokens', '?')} calls={calls}"
        )
        return Outcome(submit_body, detail, (ctx, job.payload, self.state))

    def _check_not_aborted(self, backend_reply: BackendReply, budget: int) -> None:
        """JobFault for a generation aborted on koboldcpp (its stop button), which
        says ``"length"`` as for a stop sequence: perf's ``stop_reason`` tells
        them apart (one loop only: with several, perf may be another's)."""
        if self.ports.settings.threads > 1 or not needs_stop_reason(
            backend_reply.native_finish_reason, backend_reply.completion_tokens, budget
        ):
            return
        try:
            perf = self.ports.koboldcpp.backend.perf(timeout_s=ABORT_CHECK_TIMEOUT_S)
        except BackendError:
            return
        if aborted_short(perf.get("stop_reason")):
            raise JobFault(
                f"koboldcpp's generation was aborted after {backend_reply.completion_tokens} "
                f"of {budget} tokens (a stop on koboldcpp?): not submitted cut short"
            )


def _fetch_images(
    plan: images.ImagePlan, timeout_s: float, downloads: Downloads
) -> dict[tuple[int, int], bytes]:
    """Fetch ``plan.to_fetch`` in parallel: the bytes by ``(message, part)``.
    FetchError when one failed (the queued ones are then cancelled)."""
    workers = min(IMAGE_FETCH_THREADS, len(plan.to_fetch))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="image")
    try:
        futures = {
            (i, j): pool.submit(fetch_image, url, timeout_s=timeout_s,
                                max_bytes=images.MAX_IMAGE_BYTES, downloads=downloads)
            for i, j, url in plan.to_fetch
        }
        return {key: future.result() for key, future in futures.items()}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
