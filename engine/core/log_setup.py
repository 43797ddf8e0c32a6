"""The entry points' one way to an engine with its event log: check, migrate, probe, load, open, recover.

``build_engine`` is what ``nanoserve serve`` (through ``AsyncLLMEngine``'s
loader) and the offline ``LLM`` call; ``LLMEngine`` itself is handed the opened
log and the recovery, as it is handed its runner, and never touches the
store's schema. This module is the engine package's only importer of
``nanoserve.migrations`` (tests/test_layering.py checks it)::

    prepare_log_store(config)     filesystem, migrations (unless event_log_migrate is off),
                                  a write that changes nothing, the journal's table
    load_runner(config)           the model loads only once the store is known usable (ModelRunner,
                                  in a child process under runner_process: RunnerProcess)
    open_event_log(config, ...)   a new epoch; recovery of a crashed one commits with it
    LLMEngine(config, runner=, event_log=, recovery=)

Every failure to use the store becomes EventLogUnusableError naming the store
(password hidden) and the cause, in one line: ``nanoserve serve`` exits 3 on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.llm_engine import LLMEngine
from nanoserve.engine.errors import EventLogUnusableError

if TYPE_CHECKING:
    from nanoserve.allocator.log import EventLog
    from nanoserve.engine.journal.recovery import RecoveryPlanner
    from nanoserve.engine.model.model_runner import ModelRunner
    from nanoserve.engine.model.runner_process import RunnerProcess


def build_engine(
    config: EngineConfig,
    *,
    runner: ModelRunner | RunnerProcess | None = None,
    child_setup: Callable[[], None] | None = None,
) -> LLMEngine:
    """An LLMEngine on ``config``, its event log (when ``event_log_url`` is set) opened and recovered.

    runner: a model already loaded from ``config``; None loads it, after the
    store was checked (in a child process under ``config.model.runner_process``,
    which first calls ``child_setup``, a picklable callable: the server's logging).
    Raises EventLogUnusableError when the store cannot be used (before the model
    loads) or the epoch cannot be opened (after); a load's own errors as ModelRunner
    raises them.
    """
    prepare_log_store(config)
    if runner is None:
        runner = load_runner(config, child_setup)
    try:
        event_log, recovery = open_event_log(config, runner)
        return LLMEngine(config, runner=runner, event_log=event_log, recovery=recovery)
    except BaseException:
        runner.close()  # a runner process must not outlive a start that failed
        raise


def load_runner(config: EngineConfig, child_setup: Callable[[], None] | None = None) -> ModelRunner | RunnerProcess:
    """``ModelRunner(config)``, in a child process of its own under ``config.model.runner_process`` on
    the CPU (on CUDA a step's tensors live on the device, and the forward pass holds no GIL while the
    kernels run: the runner stays in this process). Raises what ModelRunner raises."""
    from nanoserve.engine.model.device import resolve_device

    if config.model.runner_process and resolve_device(config.model.device).type == "cpu":
        from nanoserve.engine.model.runner_process import RunnerProcess

        return RunnerProcess(config, child_setup)
    from nanoserve.engine.model.model_runner import ModelRunner

    return ModelRunner(config)


def prepare_log_store(config: EngineConfig) -> None:
    """Checks the log's store before the model loads: its filesystem (SQLite), the schema (migrated
    first unless ``event_log_migrate`` is off), a write that changes nothing, the journal's table
    when the journal is kept. Nothing without ``event_log_url``. Raises EventLogUnusableError."""
    url = config.event_log.event_log_url
    if url is None:
        return
    from nanoserve.allocator.log import check_filesystem, probe_store

    with unusable_log(url):
        check_filesystem(url)
        if config.event_log.event_log_migrate:
            from nanoserve.migrations import upgrade

            upgrade(url)
        probe_store(url)
        if config.event_log.journal:
            from nanoserve.engine.journal.store import check_journal_schema

            check_journal_schema(url)


def open_event_log(
    config: EngineConfig, runner: ModelRunner | RunnerProcess
) -> tuple[EventLog | None, RecoveryPlanner | None]:
    """Opens a new epoch of the configured log for the pool ``runner`` sizes (its store checked by
    ``prepare_log_store``); returns (the log, the recovery planned in the same transaction, None
    without a journal). (None, None) without ``event_log_url``. Raises EventLogUnusableError."""
    log_config = config.event_log
    if log_config.event_log_url is None:
        return None, None
    from nanoserve.allocator.log import EventLog

    recovery: RecoveryPlanner | None = None
    if log_config.journal:
        from nanoserve.engine.journal.recovery import RecoveryPlanner

        recovery = RecoveryPlanner(log_config.journal_retention_s)
    started_s = time.perf_counter()
    with unusable_log(log_config.event_log_url):
        log = EventLog.open(
            log_config.event_log_url,
            pool_id=log_config.pool_id,
            num_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
            model=runner.model_name,
            config=_jsonable(dataclasses.asdict(config)),
            sync=log_config.event_log_sync,
            num_events_per_snapshot=log_config.num_events_per_snapshot,
            max_pending_batches=log_config.event_log_max_pending_batches,
            prepare_journal=recovery,
        )
    if recovery is not None:
        recovery.log_open_s = time.perf_counter() - started_s  # the audit and journal reads included
    return log, recovery


@contextlib.contextmanager
def unusable_log(url: str) -> Iterator[None]:
    """Turns every failure to prepare or open the log at ``url`` into EventLogUnusableError (one line)."""
    from nanoserve.allocator.log.errors import safe_url, store_cause

    try:
        yield
    except EventLogUnusableError:
        raise
    except Exception as exc:
        import sqlalchemy as sa

        lines = str(exc).strip().splitlines()
        cause = store_cause(exc) if isinstance(exc, sa.exc.SQLAlchemyError) else lines[0] if lines else ""
        raise EventLogUnusableError(safe_url(url), cause or type(exc).__name__) from exc


def _jsonable(value: Any) -> Any:
    """``value`` with torch dtypes as their names and tuples as lists: a JSON value."""
    import torch

    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    return value
