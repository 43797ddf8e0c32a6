"""``RunnerProcess``: the model runner in a process of its own, behind ``ModelRunner``'s interface.

Why: the engine thread's forward pass is a few hundred calls into compiled kernels a step,
and each one gives up the GIL and must take it back. In one process, whatever else holds the
GIL (the event loop sending a crowd of readers their messages) makes every one of those
calls wait for it, and the token rate falls by several times the loop's own CPU time
(bench.read_paths: 100 WatchEvents subscribers catching up took a stream from 106 to 42
tokens/s). With the weights, the KV cache and the kernels in a child process, a step is one
round trip over a pipe: the engine thread waits for it with the GIL released, so the loop's
work costs the forward pass only CPU, not turns. vLLM runs its engine core and its workers
in processes of their own for the same reason.

The protocol (one request at a time, from the engine thread only; the child answers each):

    parent -> child   ("forward", batch fields)     child -> parent  ("logits", num_rows, new buffer name)
                      ("copy_blocks", pairs)                          ("ok",)
                      ("close",)                                      the child exits
    any error in the child                     ("error", the exception (None if it does not pickle),
                                                               its repr, the child's traceback)

The child's first message is the runner's facts (``RunnerFacts``). Logits come back through
one shared-memory buffer, ``[capacity_rows, vocab_size]`` float32, that the child replaces
with a larger one when a step needs more rows (its name sent along), up to ``MAX_SHARED_BYTES``
(larger steps, such as a long prompt's prompt logprobs, send theirs over the pipe as
``("logits_inline", array)``); the tensor ``forward``
returns is a view of it, valid until the next ``forward``, which is how ``LLMEngine._execute``
uses it (read within the step). The child ignores SIGINT and SIGTERM (a ^C or a signal to the
process group must not cut a step off under the server's graceful shutdown): ``close`` ends it,
at the latest from an ``atexit`` hook, and when the server dies without one its pipe closes and
the child exits at its next read or reply, so it never outlives the server.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import structlog
import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.model.forward_batch import ForwardBatch
from nanoserve.engine.text.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

FLOAT32_BYTES = 4
MIN_CAPACITY_ROWS = 16  # the first logits buffer: 16 rows of the vocabulary (3 MiB at 49,152 tokens)
# the largest logits buffer: half of Docker's default /dev/shm (64 MiB), where a mapping past the limit
# faults (SIGBUS) instead of failing; a step with more rows (170 at 49,152 tokens) sends them over the pipe
MAX_SHARED_BYTES = 32 * 1024 * 1024


class RunnerProcessError(RuntimeError):
    """The runner's process failed a step (its error's repr and traceback in the message) or died."""


@dataclass(frozen=True)
class RunnerFacts:
    """What the engine reads from a runner, sent once by the child after the model loads."""

    tokenizer: Tokenizer
    model_name: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    on_gguf_kernels: bool
    weight_bytes: int
    pid: int


class RunnerProcess:
    """A ``ModelRunner`` loaded in a spawned child process; the same attributes, ``forward`` and
    ``copy_blocks``, and ``close``.

    config: the engine's configuration (the child builds ``ModelRunner(config)`` from it).
    child_setup: called first in the child (a picklable callable: the server's logging setup),
        or None.

    Raises what ``ModelRunner`` raised in the child (ValueError, FileNotFoundError, ...: the same
    type and message, the child's traceback as its cause) when that pickles, else RunnerProcessError
    naming it; RunnerProcessError when the child exits before it is ready. ``forward`` and
    ``copy_blocks`` raise the step's error the same way, and RunnerProcessError when the child died.
    """

    def __init__(self, config: EngineConfig, child_setup: Callable[[], None] | None = None) -> None:
        context = multiprocessing.get_context("spawn")  # a forked child of a process with threads can hang
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(config, child_conn, child_setup), name="nanoserve-runner", daemon=True
        )
        self._process.start()
        child_conn.close()
        try:
            facts = self._receive()
        except BaseException:
            self._process.join(5.0)  # it exits after reporting its error
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            self._conn.close()
            raise
        assert isinstance(facts, RunnerFacts)
        self.tokenizer = facts.tokenizer
        self.model_name = facts.model_name
        self.block_size = facts.block_size
        self.num_kv_blocks = facts.num_kv_blocks
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.device = facts.device
        self.dtype = facts.dtype
        self.kv_cache_dtype = facts.kv_cache_dtype
        self.on_gguf_kernels = facts.on_gguf_kernels
        self.weight_bytes = facts.weight_bytes
        self.pid = facts.pid
        log.info("model_runner.process", pid=self.pid)  # the process that holds the weights and the KV cache
        self._shm: shared_memory.SharedMemory | None = None
        self._logits: torch.Tensor | None = None  # [capacity_rows, vocab_size] float32 over _shm
        atexit.register(self.close)  # before multiprocessing's own hook, which would wait on the child

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """``ModelRunner.forward`` in the child: [num_logits, vocab_size] float32, a view of the
        shared buffer valid until the next call (rows past ``MAX_SHARED_BYTES``: a copy of its own)."""
        self._send(("forward", _batch_fields(batch)))
        reply = self._receive()
        if reply[0] == "logits_inline":
            return torch.from_numpy(reply[1])
        _, num_rows, shm_name = reply
        if shm_name is not None:
            self._attach(shm_name)
        assert self._logits is not None
        return self._logits[:num_rows]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """``ModelRunner.copy_blocks`` in the child."""
        self._send(("copy_blocks", pairs))
        self._receive()

    def close(self, timeout_s: float = 5.0) -> None:
        """Asks the child to exit and waits ``timeout_s`` seconds, then kills it; idempotent."""
        atexit.unregister(self.close)
        if self._process.is_alive():
            with contextlib.suppress(RunnerProcessError):
                self._send(("close",))
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()
        self._release()

    def _release(self) -> None:
        """Unmaps the logits buffer (the child unlinks it); a tensor still viewing it keeps the mapping
        until it is collected."""
        self._logits = None
        if self._shm is not None:
            with contextlib.suppress(BufferError):  # a view of the old logits is alive: the mapping goes with it
                self._shm.close()
            self._shm = None

    def _attach(self, name: str) -> None:
        self._release()
        # attaching registers the name with the resource tracker the child shares (spawn hands it over),
        # where it is one entry: the child's unlink removes it
        self._shm = shared_memory.SharedMemory(name=name)
        capacity_rows = self._shm.size // (FLOAT32_BYTES * self.vocab_size)
        self._logits = torch.frombuffer(self._shm.buf, dtype=torch.float32, count=capacity_rows * self.vocab_size)
        self._logits = self._logits.view(capacity_rows, self.vocab_size)

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError) as exc:
            raise RunnerProcessError(f"model runner process {self._process.pid} is gone: {exc!r}") from exc

    def _receive(self) -> Any:
        try:
            reply = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            self._process.join(1.0)
            raise RunnerProcessError(
                f"model runner process {self._process.pid} exited (exit code {self._process.exitcode})"
            ) from exc
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            _, error, description, child_traceback = reply
            if isinstance(error, BaseException):  # the child's own exception, as ModelRunner raised it
                raise error from RunnerProcessError(f"in the model runner process:\n{child_traceback}")
            raise RunnerProcessError(f"model runner process: {description}\n{child_traceback}")
        return reply


def _batch_fields(batch: ForwardBatch) -> tuple[Any, ...]:
    return (
        batch.input_ids.numpy(),
        batch.positions.numpy(),
        batch.slot_mapping.numpy(),
        batch.query_lens,
        batch.context_lens,
        batch.block_tables.numpy(),
        batch.logits_indices.numpy(),
        batch.start_positions,
        batch.as_decodes,
    )


def _to_batch(fields: tuple[Any, ...]) -> ForwardBatch:
    ids, positions, slots, query_lens, context_lens, table, logits_rows, starts, as_decodes = fields
    return ForwardBatch(
        input_ids=torch.from_numpy(ids),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=torch.from_numpy(table),
        logits_indices=torch.from_numpy(logits_rows),
        start_positions=starts,
        as_decodes=as_decodes,
    )


def _child_main(
    config: EngineConfig, conn: multiprocessing.connection.Connection, child_setup: Callable[[], None] | None
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's close ends this process (module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if child_setup is not None:
        child_setup()
    from nanoserve.engine.model.model_runner import ModelRunner

    def send(message: tuple[Any, ...] | RunnerFacts) -> None:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))  # OSError: the server is gone

    try:
        runner = ModelRunner(config)
    except BaseException as exc:
        _send_error(send, exc)
        return
    send(
        RunnerFacts(
            tokenizer=runner.tokenizer,
            model_name=runner.model_name,
            block_size=runner.block_size,
            num_kv_blocks=runner.num_kv_blocks,
            max_model_len=runner.max_model_len,
            vocab_size=runner.vocab_size,
            device=runner.device,
            dtype=runner.dtype,
            kv_cache_dtype=runner.kv_cache_dtype,
            on_gguf_kernels=runner.on_gguf_kernels,
            weight_bytes=runner.weight_bytes,
            pid=os.getpid(),
        )
    )
    shm: shared_memory.SharedMemory | None = None
    buffer: np.ndarray | None = None  # [capacity_rows, vocab_size] float32 over shm
    try:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the server is gone
            try:
                if message[0] == "close":
                    return
                if message[0] == "copy_blocks":
                    runner.copy_blocks(message[1])
                    send(("ok",))
                    continue
                logits = runner.forward(_to_batch(message[1]))  # [num_rows, vocab_size] float32
                num_rows = int(logits.shape[0])
                max_rows = max(1, MAX_SHARED_BYTES // (FLOAT32_BYTES * runner.vocab_size))
                if num_rows > max_rows:  # more than the buffer may hold: these rows go over the pipe
                    send(("logits_inline", logits.numpy()))
                    continue
                new_name = None
                if buffer is None or num_rows > buffer.shape[0]:
                    capacity_rows = min(max_rows, max(MIN_CAPACITY_ROWS, 1 << max(0, num_rows - 1).bit_length()))
                    old = shm
                    shm = shared_memory.SharedMemory(
                        create=True, size=capacity_rows * runner.vocab_size * FLOAT32_BYTES
                    )
                    buffer = np.ndarray((capacity_rows, runner.vocab_size), np.float32, buffer=shm.buf)
                    new_name = shm.name
                    if old is not None:
                        old.close()
                        old.unlink()  # the parent has it mapped until it attaches the new one
                buffer[:num_rows] = logits.numpy()
                send(("logits", num_rows, new_name))
            except Exception as exc:
                _send_error(send, exc)
    except OSError:
        return  # the server is gone (its end of the pipe closed under a reply)
    finally:
        buffer = None
        if shm is not None:
            shm.close()
            shm.unlink()


def _send_error(send: Callable[[tuple[Any, ...]], None], exc: BaseException) -> None:
    """The exception itself when it pickles (the parent raises it again), else its repr."""
    description, child_traceback = repr(exc), traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(exc))
        error: BaseException | None = exc
    except Exception:
        error = None
    send(("error", error, description, child_traceback))
