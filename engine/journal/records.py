"""The request journal: what each request was asked, what it released, how it ended.

The engine hands the log one ``JournalRecord`` per admission, per released
output delta and per ending, beside the allocator events of the same step
(``EventLog.append_batch(step, events, journal=...)``); the writer stores them
in ``request_journal`` in the same transaction (one group commit, one durable
watermark: ``EventLog.durable_journal_seq`` moves with ``durable_seq``).

Storage: one ``journal_steps`` row per step holds that step's records in the
binary layout of ``step_codec``, hash-chained per epoch (``journal_chain``);
``journal_requests`` indexes each ADMIT by request id. Logs written before
migration 0005 hold one ``request_journal`` row per record (``record``: the
payload's JSON text); the readers read both.

Payloads:

- ADMIT: ``prompt_token_ids``, ``prompt`` (text or None), ``sampling`` (the
  request's SamplingParams fields, ``seed`` the effective one: the client's, or
  the server's choice for an unseeded request), ``max_tokens`` (resolved),
  ``arrival_wall_ns``, ``deadline_wall_ns`` (None: no deadline),
  ``recovered_from`` (the crashed epoch for a re-admission, else None),
  ``num_prior_tokens`` (outputs already journaled at a re-admission).
- OUTPUT: ``start`` (index of the first token of the delta in the request's
  released output), ``token_ids``, ``text``, ``logprobs`` (``[[token_id,
  logprob, [[top_id, top_logprob], ...]], ...]``, only when asked for).
- FINISH: an OUTPUT's fields (the last delta) plus ``finish_reason``,
  ``stop_reason``, ``abort_cause``, ``queue_s``, ``ttft_s``, ``total_s``,
  ``num_preemptions``.
- RECOVER (request_id ""): the crashed epoch this epoch took over
  (``epoch``), its last durable seq and who held which blocks there
  (``holders``: owner -> block ids, from the audit), the request ids
  re-admitted and those left ended (``ended``: id -> cause).

A request's history spans epochs: its latest fresh ADMIT (``recovered_from``
None), then every record of that id after it, re-admissions included.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nanoserve.engine.errors import JournalGapError


class JournalKind(str, enum.Enum):
    ADMIT = "admit"
    OUTPUT = "output"
    FINISH = "finish"
    RECOVER = "recover"


def encode_journal(data: dict[str, Any]) -> str:
    """One record's JSON text (compact, keys in the engine's order)."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class JournalEntry:
    """One stored journal record, decoded."""

    epoch: int
    journal_seq: int
    request_id: str
    kind: str
    step: int | None
    wall_ns: int
    data: dict[str, Any]


@dataclass(frozen=True)
class OutputChunk:
    """One released delta of a request: tokens ``start .. start + len(token_ids)``."""

    start: int
    token_ids: list[int]
    text: str
    logprobs: list[Any] | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class RequestHistory:
    """One request's journal across epochs: its admission, released chunks in order, ending.

    chunks: contiguous from index 0 (a chunk journaled twice, before and after a
    crash, is kept once). finish: the FINISH payload, None while unfinished.
    epochs: the epochs that hold records of it, in order.
    """

    request_id: str
    admit: dict[str, Any]
    admit_epoch: int
    chunks: list[OutputChunk] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    epochs: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.chunks[-1].end if self.chunks else 0

    @property
    def token_ids(self) -> list[int]:
        return [token_id for chunk in self.chunks for token_id in chunk.token_ids]

    @property
    def text(self) -> str:
        return "".join(chunk.text for chunk in self.chunks)

    @property
    def logprobs(self) -> list[Any] | None:
        if self.admit.get("sampling", {}).get("logprobs") is None:
            return None
        return [entry for chunk in self.chunks for entry in (chunk.logprobs or [])]

    def add(self, kind: str, data: dict[str, Any]) -> None:
        """Applies one later record of this request (OUTPUT, FINISH or a re-admission).

        JournalGapError for a delta that starts past the tokens journaled so far (one is missing)."""
        if kind in (JournalKind.OUTPUT.value, JournalKind.FINISH.value):
            start = data["start"]
            token_ids = list(data["token_ids"])
            if start > self.num_tokens:
                raise JournalGapError(self.request_id, f"tokens {self.num_tokens}..{start} missing")
            if start == self.num_tokens and (token_ids or data.get("text")):
                self.chunks.append(OutputChunk(start, token_ids, data.get("text", ""), data.get("logprobs")))
            if kind == JournalKind.FINISH.value and self.finish is None:
                self.finish = data


def request_history(rows: Iterable[tuple[int, str, dict[str, Any]]], request_id: str) -> RequestHistory | None:
    """The history of ``request_id`` from its records ``(epoch, kind, payload)`` in (epoch, journal_seq)
    order: from its latest fresh admission on; None when it was never admitted. JournalGapError
    when a released delta is missing."""
    decoded = list(rows)
    fresh = [
        i
        for i, (_, kind, data) in enumerate(decoded)
        if kind == JournalKind.ADMIT.value and data.get("recovered_from") is None
    ]
    if not fresh:
        return None
    epoch, _, admit = decoded[fresh[-1]]
    history = RequestHistory(request_id, admit, epoch, epochs=[epoch])
    for epoch, kind, data in decoded[fresh[-1] + 1 :]:
        if history.epochs[-1] != epoch:
            history.epochs.append(epoch)
        history.add(kind, data)
    return history
