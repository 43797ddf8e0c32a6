"""ResumeFollowers: Resume calls that stream a request's journaled tokens, then its live ones.

A Resume call reads the request's history from the journal on a reader thread
(``LogReads``: a bounded number at a time), streams it from the asked token on,
and, while the request still runs here, follows its live outputs from where
the journal left off. Following is registered before the journal is read, so
no output falls between the two: a live output the journal already held is
skipped by its token count.

The history is decoded into outputs on the reader thread, a few hundred
tokens per output (``TOKENS_PER_RESUME_OUTPUT``), so the event loop only cuts
the first one at the asked token. A finished request's outputs cannot change
(until its id is reused, which ``forget`` marks): the last few are kept
(``MAX_CACHED_TOKENS``), and callers resuming the same request while it is
being read share that one read.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.log_reads import LogReads, ReadPacer
from nanoserve.engine.core.outputs import RequestOutput
from nanoserve.engine.core.status import scope_of
from nanoserve.engine.errors import InvalidRequestError, RequestNotFoundError
from nanoserve.engine.journal.records import RequestHistory
from nanoserve.engine.journal.request_journal import ended_output, history_outputs, slice_output

TOKENS_PER_RESUME_OUTPUT = 256  # journaled chunks joined into one Resume output, at least this many tokens
MAX_CACHED_TOKENS = 65_536  # tokens of finished requests' decoded outputs kept for repeated Resumes


@dataclass(frozen=True)
class JournaledRequest:
    """One request as the journal holds it: its history and the outputs that replay it from token 0."""

    history: RequestHistory | None  # None: the journal never saw the id
    outputs: tuple[RequestOutput, ...]  # history_outputs(history, 0, TOKENS_PER_RESUME_OUTPUT)

    @property
    def finished(self) -> bool:
        return self.history is not None and self.history.finish is not None

    @property
    def num_tokens(self) -> int:
        return self.history.num_tokens if self.history is not None else 0

    def outputs_from(self, after_token_index: int) -> Iterator[RequestOutput]:
        """The outputs holding tokens at ``after_token_index`` or later (the first cut to start there,
        with the text of the journaled chunks none of whose tokens is cut), then the final output
        when the request ended: the tokens and text ``history_outputs(history, after_token_index)`` gives."""
        for output in self.outputs:
            end = output.num_released_tokens
            if end <= after_token_index and not output.finished:
                continue
            text = ""
            if self.history is not None and output.delta_start_index < after_token_index:
                text = "".join(c.text for c in self.history.chunks if after_token_index <= c.start < end)
            yield slice_output(output, after_token_index, text)


class ResumeFollowers:
    """The queues of the Resume calls following live requests (event loop only).

    Invariant: ``_queues`` holds a request id exactly while at least one
    Resume call follows it; each call's queue receives every output of that
    request delivered after the call began. ``_finished`` holds only finished
    requests whose id has not been reused since they were read, at most
    MAX_CACHED_TOKENS tokens in all; ``_reading`` the reads in flight that may
    fill it.

    read: the request's journaled form (blocking: LogReads runs it on a reader thread).
    is_live: a request with this id runs here now.
    pacer: the journaled outputs go out at its pace, by their tokens, under the id's scope.
    """

    def __init__(
        self,
        read: Callable[[str], JournaledRequest],
        is_live: Callable[[str], bool],
        reads: LogReads,
        pacer: ReadPacer | None = None,
    ) -> None:
        self._read = read
        self._is_live = is_live
        self._reads = reads
        self._pacer = pacer
        self._queues: dict[str, set[asyncio.Queue[RequestOutput]]] = {}  # request_id -> followers' queues
        self._finished: collections.OrderedDict[str, JournaledRequest] = collections.OrderedDict()  # LRU
        self._num_cached_tokens = 0
        self._reading: dict[str, asyncio.Future[JournaledRequest]] = {}  # request_id -> shared read in flight
        self.num_reads = 0  # journal reads made (repeated Resumes of a finished request share one)

    def deliver(self, output: RequestOutput) -> None:
        """Hands ``output`` to every call following its request."""
        for follower in self._queues.get(output.request_id, ()):
            follower.put_nowait(output)

    def forget(self, request_id: str) -> None:
        """A new request takes ``request_id``: what was read of the old one no longer answers Resume."""
        cached = self._finished.pop(request_id, None)
        if cached is not None:
            self._num_cached_tokens -= cached.num_tokens
        self._reading.pop(request_id, None)

    async def follow(self, request_id: str, after_token_index: int) -> AsyncIterator[RequestOutput]:
        """Request ``request_id``'s outputs from output token ``after_token_index`` on: the journaled
        ones, then the live ones, ending with its final output (``AsyncLLMEngine.resume``).

        Raises InvalidRequestError for a negative index, RequestNotFoundError when the journal
        never saw the id and no live request has it.
        """
        if after_token_index < 0:
            raise InvalidRequestError("after_token_index", f"must be >= 0, got {after_token_index}")
        follower: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues.setdefault(request_id, set()).add(follower)
        try:
            live = self._is_live(request_id)
            journaled = await (self._read_now(request_id) if live else self._read_shared(request_id))
            if journaled.history is None and not live:
                raise RequestNotFoundError(
                    f"request_id: no request {request_id!r} running or in the live journal (never seen, or its "
                    "history was archived: read it from its archive file with `nanoserve log requests --url`)"
                )
            if journaled.history is not None:
                _check_one_sample(request_id, journaled.history.admit)
            next_index = after_token_index
            for output in journaled.outputs_from(after_token_index):
                if self._pacer is not None:
                    await self._pacer.take(scope_of(request_id), max(1, len(output.delta_token_ids)))
                yield output
                next_index = max(next_index, output.num_released_tokens)
            if journaled.finished:
                return
            if not live:
                yield ended_output(journaled.history, request_id)
                return
            while True:
                output = await follower.get()
                if output.num_released_tokens > next_index or output.finished:
                    yield slice_output(output, next_index)
                    next_index = max(next_index, output.num_released_tokens)
                if output.finished:
                    return
        finally:
            followers = self._queues.get(request_id)
            if followers is not None:
                followers.discard(follower)
                if not followers:
                    del self._queues[request_id]

    async def _read_now(self, request_id: str) -> JournaledRequest:
        """A read of its own: a live request's journal grows while it runs."""
        self.num_reads += 1
        return await self._reads.run(self._read, request_id, scope=scope_of(request_id))

    async def _read_shared(self, request_id: str) -> JournaledRequest:
        """The cached read of a finished request, or the one in flight, or a new one the next callers share."""
        cached = self._finished.get(request_id)
        if cached is not None:
            self._finished.move_to_end(request_id)
            return cached
        shared = self._reading.get(request_id)
        if shared is None:
            shared = asyncio.ensure_future(self._read_now(request_id))
            self._reading[request_id] = shared
            shared.add_done_callback(lambda done: self._keep(request_id, done))
        # one caller leaving must not cancel the read the others wait for
        return await asyncio.shield(shared)

    def _keep(self, request_id: str, done: asyncio.Future[JournaledRequest]) -> None:
        if self._reading.get(request_id) is not done:
            return  # forgotten meanwhile: the id was reused
        del self._reading[request_id]
        if done.cancelled() or done.exception() is not None:
            return
        journaled = done.result()
        if not journaled.finished or journaled.num_tokens > MAX_CACHED_TOKENS:
            return
        self._finished[request_id] = journaled
        self._num_cached_tokens += journaled.num_tokens
        while self._num_cached_tokens > MAX_CACHED_TOKENS:
            _, evicted = self._finished.popitem(last=False)
            self._num_cached_tokens -= evicted.num_tokens


def read_journaled(config: EngineConfig, request_id: str) -> JournaledRequest:
    """Request ``request_id`` as ``config``'s journal holds it, decoded into Resume outputs (blocking:
    a reader thread)."""
    from nanoserve.allocator.log.reader import connect
    from nanoserve.engine.journal.store import read_request_history

    url = config.event_log.event_log_url
    assert url is not None, "only an engine that keeps a journal reads it"
    with connect(url) as conn:
        history = read_request_history(conn, config.event_log.pool_id, request_id)
    if history is None:
        return JournaledRequest(None, ())
    return JournaledRequest(history, tuple(history_outputs(history, 0, TOKENS_PER_RESUME_OUTPUT)))


def _check_one_sample(request_id: str, admit: dict[str, Any]) -> None:
    """Resume serves requests of one sample: the journal keeps no tokens of parallel samples (n, best_of)."""
    sampling = admit.get("sampling") or {}
    num_samples = sampling.get("best_of") or sampling.get("n") or 1
    if num_samples > 1:
        raise InvalidRequestError(
            "request_id",
            f"request {request_id!r} has {num_samples} samples (n / best_of): Resume serves one-sample requests "
            "only (the journal keeps no tokens of parallel samples)",
        )
