"""``SampleGroup``: the samples of one request with ``n`` / ``best_of`` above 1 (parallel sampling).

The request itself (the *parent*) is prefilled once; when its prompt's last
chunk yields logits it stops being scheduled and its block table is forked
into one child ``Request`` per sample (``BlockTable.fork``; Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, section 4.4). The parent keeps holding the prompt's
blocks until every sample has ended, so each sample's copy of the partly
filled last block always comes from a block its parent holds (the audit's
``copy_source_not_parents``), and a preempted sample recomputes alone.

Child i: request id / block-table owner ``"<request_id>#<i>"``, seed
``counter_rng.sample_seed(parent seed, i)``; its outputs carry the parent's
request id and serial and ``CompletionOutput.index`` i.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from nanoserve.engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.engine.core.request import Request
from nanoserve.engine.sampling.counter_rng import sample_seed

if TYPE_CHECKING:
    import torch

    from nanoserve.engine.core.scheduler import Scheduler


class SampleGroup:
    """A parent request and its samples.

    Invariant: ``children[i].index == i``; ``finals`` holds the final
    completion of every ended child, by index; the group has ended when all
    ``num_samples`` have one.
    """

    def __init__(self, parent: Request, serials: list[int]) -> None:
        params = parent.sampling_params
        self.parent = parent
        self.n = params.n
        self.streams = params.best_of is None or params.best_of == params.n  # best_of > n: only the end
        self.children = [_child(parent, index, serial) for index, serial in enumerate(serials)]
        self.finals: dict[int, CompletionOutput] = {}  # index -> final completion
        self.cumulative_logprobs = [0.0] * len(self.children)  # index -> sum of its tokens' logprobs
        for child in self.children:
            child.group = self

    @property
    def live_children(self) -> list[Request]:
        return [child for child in self.children if child.index not in self.finals]

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.children)

    def child_output(self, child: Request, output: RequestOutput | None) -> RequestOutput | None:
        """A child's output as the client sees it: the parent's id, serial and metrics (its own finish
        time on its last output), the child's index.

        None when nothing is streamed (best_of > n) or nothing is new. A
        child's final output is recorded and goes out as a non-final one: only
        the group's output (``final_output``) ends the request.
        """
        if output is None:
            return None
        completion = output.outputs[0]
        if output.finished:
            self.finals[child.index] = completion
        if not self.streams:
            return None
        metrics = RequestMetrics(**vars(self.parent.metrics))
        if completion.finish_reason is not None and output.metrics is not None:
            metrics.finished_time = output.metrics.finished_time  # the sample's end: its stream's total time
        return dataclasses.replace(
            output,
            request_id=self.parent.request_id,
            finished=False,
            serial=self.parent.serial,
            metrics=metrics,
            prompt=self.parent.prompt,
            abort_cause=None,
        )

    def final_output(self) -> RequestOutput:
        """The request's final output: the n best samples by cumulative logprob (best_of), else all n, by index.

        With best_of the kept samples are numbered 0..n-1 in rank order (highest first, ties by index).
        """
        assert self.done, f"{len(self.children) - len(self.finals)} samples are still running"
        indices = list(range(len(self.children)))
        if not self.streams:
            indices = sorted(indices, key=lambda i: (-self.cumulative_logprobs[i], i))[: self.n]
        outputs = [dataclasses.replace(self.finals[i], index=rank) for rank, i in enumerate(indices)]
        if self.streams:
            outputs = [self.finals[i] for i in indices]
        parent = self.parent
        return RequestOutput(
            request_id=parent.request_id,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=True,
            metrics=RequestMetrics(**vars(parent.metrics)),
            prompt=parent.prompt,
            serial=parent.serial,
            abort_cause=parent.abort_cause,
            samples_streamed=self.streams,
        )


def _child(parent: Request, index: int, serial: int) -> Request:
    """Sample ``index`` of ``parent``: its prompt, its own seed, nothing generated yet."""
    params = dataclasses.replace(parent.sampling_params, seed=sample_seed(parent.seed, index), n=1, best_of=None)
    child = Request(
        f"{parent.request_id}#{index}",
        parent.prompt_token_ids,
        params,
        max_tokens=parent.max_tokens,
        eos_token_ids=parent.eos_token_ids,
        decoder=parent.decoder,
        prompt=parent.prompt,
        arrival_time=parent.metrics.arrival_time,
        serial=serial,
    )
    child.index = index
    return child


def fork_prefilled(
    sampled: list[Request], scheduler: Scheduler, serials: Iterator[int]
) -> tuple[list[Request], list[int]]:
    """Forks each request of ``sampled`` with several samples whose prompt is now computed (its
    ``SampleGroup`` made, its block table forked by ``scheduler``, each child taking the next of
    ``serials``); returns who samples from which logits row: each sample of a forked request draws
    its first token from the parent's row, with its own seed."""
    rows: list[Request] = []
    row_logits: list[int] = []
    for index, request in enumerate(sampled):
        if request.sampling_params.num_samples > 1 and request.group is None:
            group = SampleGroup(request, [next(serials) for _ in range(request.sampling_params.num_samples)])
            request.group = group
            scheduler.fork(request, group.children)
            rows.extend(group.children)
            row_logits.extend([index] * len(group.children))
        else:
            rows.append(request)
            row_logits.append(index)
    return rows, row_logits


def add_cumulative_logprobs(logits: torch.Tensor, rows: list[Request], token_ids: list[int]) -> None:
    """Adds each ranked sample's token log-probability to its group's sum: best_of ranks samples by the
    sum under the model (the raw logits, ``[len(rows), vocab_size]``)."""
    ranked = [i for i, request in enumerate(rows) if request.group is not None and not request.group.streams]
    if not ranked:
        return
    logprobs = logits[ranked].float().log_softmax(dim=-1)  # [len(ranked), vocab_size]
    for row, i in enumerate(ranked):
        group = rows[i].group
        assert group is not None
        group.cumulative_logprobs[rows[i].index] += float(logprobs[row, token_ids[i]])
