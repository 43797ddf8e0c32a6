"""The audit's C fold (``intact_fold``) gives the Python replay's report, proved on random logs (Hypothesis).

Each example writes an epoch into a SQLite log as the writer stores it (packed
rows, keys named by id in ``allocator_keys``, SNAPSHOTs), from a random
serving workload on the allocator (prefix caching, plain allocations, frees,
preemptions, sometimes a fork or a cache reset, which the fold leaves to
Python), then damages it or not: records edited and the chain sealed again
(so the rules, not the hashes, must find it), records edited under their old
hashes, rows deleted, key rows or blobs altered, the epoch's row edited. The
audit through the fold and the audit by the Python replay alone must give
equal reports (state, dict order included, and every violation), and a clean
epoch without a fork or a reset must be folded.

Skipped by name when the fold cannot be built here (no C compiler, zlib or OpenSSL headers).
"""

from __future__ import annotations

import random
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.allocator import (
    BlockAllocator,
    BlockEvent,
    BlockTable,
    EventKind,
    FreeReason,
    KVCacheExhausted,
    extend_block_keys,
)
from nanoserve.allocator.log import EventLog, intact_fold_build
from nanoserve.allocator.log.audit import AuditReport, audit, audit_epoch
from nanoserve.allocator.log.batch import Batch, seal_event_rows
from nanoserve.allocator.log.hash_chain import chain_hash
from nanoserve.allocator.log.key_refs import KeyIds
from nanoserve.allocator.log.reader import connect, resolve_epoch
from nanoserve.allocator.log.record_codec import split_record
from nanoserve.allocator.log.schema import allocator_events, allocator_keys, pool_epochs
from nanoserve.allocator.log.snapshot_codec import snapshot_data
from nanoserve.allocator.log.store import Row, create_log_engine, insert_rows
from nanoserve.migrations import upgrade

NUM_BLOCKS = 24
BLOCK_SIZE = 4
POOL_ID = "fold"

pytestmark = pytest.mark.skipif(
    intact_fold_build.load() is None, reason=f"intact_fold not built: {intact_fold_build.unavailable_reason()}"
)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated log whose epoch 1 is open with its POOL_INIT stored, abandoned as SIGKILL leaves it."""
    path = tmp_path_factory.mktemp("fold") / "template.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    log = EventLog.open(url, pool_id=POOL_ID, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    log._writer.abandon()
    log._release()
    return path


def workload(seed: int, num_steps: int, with_family: bool) -> Iterator[tuple[list[BlockEvent], BlockAllocator]]:
    """Scheduler steps of a random workload: each step's events and the pool after them."""
    rng = random.Random(seed)
    pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    running: dict[str, BlockTable] = {}
    plain: dict[str, list[int]] = {}
    serial = 0
    for _ in range(num_steps):
        for _ in range(rng.randint(1, 4)):
            what = rng.random()
            serial += 1
            owner = rng.choice((f"r{serial}", f"r{serial}|x", f"r\u00e9{serial}", f'q"{serial}\\'))
            try:
                if what < 0.35:
                    tokens = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
                    keys = extend_block_keys([], tokens, BLOCK_SIZE)
                    hits, _ = pool.count_prefix_hits(owner, keys[: (len(tokens) - 1) // BLOCK_SIZE])
                    table = BlockTable(pool, owner)
                    try:
                        table.append_tokens(len(tokens) - table.share_prefix(keys[:hits]))
                        table.register(keys, len(tokens))
                    except KVCacheExhausted:
                        table.release(FreeReason.ABORTED)
                        continue
                    running[owner] = table
                elif what < 0.5:
                    reason = rng.choice((None, FreeReason.DRAFT)) if rng.random() < 0.1 else None
                    plain[owner] = pool.allocate_for(rng.randint(1, 3 * BLOCK_SIZE), owner, reason)
                elif what < 0.7 and running:
                    name = rng.choice(list(running))
                    running.pop(name).release(rng.choice((FreeReason.FINISHED, FreeReason.PREEMPTED)))
                elif what < 0.85 and plain:
                    name = rng.choice(list(plain))
                    pool.free_all(plain.pop(name)[::-1], rng.choice((FreeReason.FINISHED, FreeReason.ABORTED)))
                elif what < 0.95 and running:
                    table = running[rng.choice(list(running))]
                    if table.can_append(1):
                        table.append_tokens(1)
                elif with_family and running and rng.random() < 0.5:
                    parent = rng.choice(list(running))
                    running[owner] = running[parent].fork(owner)
                elif with_family:
                    pool.reset_prefix_cache("admin")
            except (KVCacheExhausted, ValueError):
                continue
        yield pool.take_events(), pool


def write_epoch(path: Path, seed: int, num_steps: int, close: bool, with_family: bool, edit: Any = None) -> str:
    """Store a workload's epoch in ``path`` as the writer does (a commit of 1-3 steps at a time, packed,
    keys by id); ``edit(rows)`` may change the rows of the whole epoch before they are stored."""
    url = f"sqlite:///{path}"
    engine = create_log_engine(url)
    with engine.connect() as conn:
        seq, head = conn.execute(sa.select(pool_epochs.c.durable_seq, pool_epochs.c.head_hash)).one()
    start_hash = head  # POOL_INIT's, which the first row written here chains from
    commits: list[list[Row]] = []
    rng = random.Random(seed + 1)
    step = 0
    pending: list[Row] = []
    last_pool = None
    for events, pool in workload(seed, num_steps, with_family):
        step += 1
        last_pool = pool
        if not events:
            continue
        data = snapshot_data(pool.snapshot()) if rng.random() < 0.15 else None
        kind = None if data is None else EventKind.SNAPSHOT
        batch = Batch(seq + 1, step, 1000 + step, step, events, kind, data)
        sealed = seal_event_rows([batch], POOL_ID, 1, seq + 1, head)
        pending += sealed.rows
        seq, head = sealed.last_seq, sealed.head_hash
        if rng.random() < 0.5:
            commits.append(pending)
            pending = []
    closed_seq = None
    if close and last_pool is not None:
        batch = Batch(seq + 1, None, 0, 0, (), EventKind.POOL_CLOSE, {"num_free": last_pool.num_free})
        sealed = seal_event_rows([batch], POOL_ID, 1, seq + 1, head)
        pending += sealed.rows
        seq, head, closed_seq = sealed.last_seq, sealed.head_hash, sealed.closed_seq
    commits.append(pending)
    if edit is not None:
        commits, head = edit(commits, start_hash, head)
    key_ids = KeyIds()
    with engine.begin() as conn:
        for rows in commits:
            if rows:
                insert_rows(conn, rows, key_ids)
                key_ids.commit()
        conn.execute(sa.update(pool_epochs).values(durable_seq=seq, head_hash=head, closed_seq=closed_seq))
    engine.dispose()
    return url


def resealed(commits: list[list[Row]], records: dict[int, str], previous: bytes) -> tuple[list[list[Row]], bytes]:
    """The commits with the records at some seqs replaced and every hash chained again from ``previous``."""
    out = []
    for rows in commits:
        new = []
        for row in rows:
            record = records.get(row[2], row[5])
            fields = split_record(record)
            kind = fields[2] if len(fields) == 9 else row[3]
            owner = (
                None if kind in ("pool_init", "snapshot", "pool_close") else fields[-1] if len(fields) == 9 else None
            )
            previous = chain_hash(previous, record)
            new.append((row[0], row[1], row[2], kind, owner, record, previous, row[7]))
        out.append(new)
    return out, previous


NUMBERS = ("", "x", "0", "1", "2", "7", "23", "24", "99", "01", " 2")
REASONS = ("", "finished", "aborted", "draft", "bogus")


def edited_record(record: str, rng: random.Random) -> str:
    """``record`` with one field or one prefix-cache entry changed."""
    fields = split_record(record)
    if len(fields) != 9:
        return record + "|x"
    what = rng.randrange(9)
    if what == 0:
        fields[rng.choice((0, 1))] = rng.choice(NUMBERS)
    elif what == 1:
        fields[2] = rng.choice(("allocate", "free_all", "register", "share", "release", "evict", "bogus", "snapshot"))
    elif what in (2, 3):
        ids = fields[3].split(",")
        ids[rng.randrange(len(ids))] = rng.choice(NUMBERS)
        fields[3] = ",".join(rng.sample(ids, len(ids)) if rng.random() < 0.3 else ids)
    elif what == 4:
        reason, separator, entries = fields[5].partition(";")
        fields[5] = rng.choice(REASONS) + separator + entries
    elif what in (5, 6) and ";" in fields[5]:
        reason, _, text = fields[5].partition(";")
        entries = text.split(",")
        index = rng.randrange(len(entries))
        entry = entries[index]
        edits = [entry[:-1], entry + "0", entry.replace("=", "=1", 1), entry.replace("~", "", 1), "", entry + ":"]
        entries[index] = rng.choice(edits)
        if rng.random() < 0.3:
            entries.reverse()
        fields[5] = reason + ";" + ",".join(entries)
    elif what == 7:
        fields[8] = rng.choice(("r1", "", "zz", fields[8] + "x"))
    else:
        return "|".join(fields[: rng.randrange(9)])
    return "|".join(fields)


def damage(path: Path, url: str, rng: random.Random) -> None:
    """An edit of the stored log itself: a row, a blob, a key row, or the epoch's row."""
    engine = create_log_engine(url)
    events = allocator_events.c
    with engine.begin() as conn:
        seqs = [row[0] for row in conn.execute(sa.select(events.seq, events.last_seq))]
        seq = rng.choice(seqs)
        what = rng.randrange(8)
        where = (events.pool_id == POOL_ID, events.epoch == 1, events.seq == seq)
        if what == 0:
            conn.execute(sa.delete(allocator_events).where(*where))
        elif what == 1:
            blob = conn.execute(sa.select(events.records).where(*where)).scalar()
            if blob:
                flipped = bytearray(blob)
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
                conn.execute(sa.update(allocator_events).where(*where).values(records=bytes(flipped)))
        elif what == 2:
            conn.execute(sa.update(allocator_events).where(*where).values(hash=b"\0" * 32))
        elif what == 3:
            keys = conn.execute(sa.select(allocator_keys.c.first_key_id, allocator_keys.c.block_keys)).all()
            if keys:
                first, blob = rng.choice(keys)
                altered = b"\1" + bytes(blob[1:]) if rng.random() < 0.5 else bytes(blob[:-32])
                conn.execute(
                    sa.update(allocator_keys).where(allocator_keys.c.first_key_id == first).values(block_keys=altered)
                )
        elif what == 4:
            conn.execute(sa.update(allocator_events).where(*where).values(kind="free", owner="r1"))
        elif what == 5:
            conn.execute(sa.update(pool_epochs).values(durable_seq=pool_epochs.c.durable_seq + 1))
        elif what == 6:
            blob = conn.execute(sa.select(events.records).where(*where)).scalar()
            if blob and blob[:1] == b"\2":
                text = zlib.decompress(blob[1:], -15)
                deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
                text = text.replace(b"\x1f", b"\x1f9", 1) if rng.random() < 0.5 else text + b"\nx"
                conn.execute(
                    sa.update(allocator_events)
                    .where(*where)
                    .values(records=b"\2" + deflate.compress(text) + deflate.flush())
                )
        else:
            conn.execute(sa.update(pool_epochs).values(closed_seq=None))
    engine.dispose()


def both_audits(url: str) -> tuple[AuditReport, AuditReport]:
    """(the audit with the fold, the audit by the Python replay alone) of the log's epoch 1."""
    with connect(url) as conn:
        folded = audit_epoch(conn, resolve_epoch(conn, POOL_ID, 1))
    with connect(url) as conn:
        replayed = audit_epoch(conn, resolve_epoch(conn, POOL_ID, 1), fold=False)
    return folded, replayed


def assert_same(folded: AuditReport, replayed: AuditReport) -> None:
    assert not replayed.folded
    assert folded == replayed
    assert folded.render() == replayed.render()
    assert [violation.plot_range for violation in folded.violations] == [
        violation.plot_range for violation in replayed.violations
    ]
    for name in ("owners", "sharers", "block_keys", "key_blocks"):  # what the report's state lists, in order
        assert list(getattr(folded.state, name).items()) == list(getattr(replayed.state, name).items())


EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@EXAMPLES
@given(seed=st.integers(0, 2**32 - 1), num_steps=st.integers(1, 60), close=st.booleans(), family=st.booleans())
def test_a_clean_epoch_is_folded_into_the_python_replays_report(
    template: Path, tmp_path: Path, seed: int, num_steps: int, close: bool, family: bool
) -> None:
    path = tmp_path / f"clean-{seed}.db"
    shutil.copy(template, path)
    url = write_epoch(path, seed, num_steps, close, family)
    folded, replayed = both_audits(url)
    assert_same(folded, replayed)
    kinds = {row[0] for row in _records(url)}
    if replayed.clean and not kinds & {"fork", "copy", "cache_reset"}:
        assert folded.folded


@EXAMPLES
@given(
    seed=st.integers(0, 2**32 - 1),
    num_steps=st.integers(1, 40),
    close=st.booleans(),
    how=st.sampled_from(("resealed", "resealed", "resealed", "unsealed", "stored")),
)
def test_a_damaged_epoch_gives_the_python_replays_report(
    template: Path, tmp_path: Path, seed: int, num_steps: int, close: bool, how: str
) -> None:
    rng = random.Random(seed)
    path = tmp_path / f"damaged-{seed}.db"
    shutil.copy(template, path)

    def edit(commits: list[list[Row]], start_hash: bytes, head: bytes) -> tuple[list[list[Row]], bytes]:
        rows = [row for commit in commits for row in commit]
        chosen = rng.sample(rows, min(len(rows), rng.randint(1, 2)))
        records = {row[2]: edited_record(row[5], rng) for row in chosen}
        if how == "resealed":
            return resealed(commits, records, start_hash)
        return [[(*row[:5], records.get(row[2], row[5]), *row[6:]) for row in commit] for commit in commits], head

    url = write_epoch(path, seed, num_steps, close, False, edit if how != "stored" else None)
    if how == "stored":
        damage(path, url, rng)
    folded, replayed = both_audits(url)
    assert_same(folded, replayed)
    if folded.folded:  # only the checks both paths share after the replay may find something
        assert {violation.rule for violation in folded.violations} <= {"leaked_block", "rollback_of_non_draft"}


def _records(url: str) -> list[list[str]]:
    """Every record's fields (kind first), read by the log's own reader."""
    from nanoserve.allocator.log.reader import event_rows

    with connect(url) as conn:
        return [
            [split_record(row[3])[2]] for chunk in event_rows(conn, POOL_ID, 1) for row in chunk if type(row[3]) is str
        ]


def known_epoch(path: Path) -> tuple[list[BlockEvent], str]:
    """Two requests share a registered prompt block; one ends (its reference released), the other holds on.
    Stored as one packed row and a SNAPSHOT after POOL_INIT; returns the events and the block's key."""
    pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    keys = extend_block_keys([], [1, 2, 3, 4, 5], BLOCK_SIZE)  # one full block, then a partial one
    first = BlockTable(pool, "a")
    first.append_tokens(5)
    first.register(keys, 5)
    second = BlockTable(pool, "b")
    second.append_tokens(5 - second.share_prefix(keys[:1]))
    first.release(FreeReason.FINISHED)
    events = pool.take_events()
    sealed = seal_event_rows(
        [Batch(2, 1, 10, 10, events, EventKind.SNAPSHOT, snapshot_data(pool.snapshot()))],
        POOL_ID,
        1,
        2,
        _head(path),
    )
    engine = create_log_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        insert_rows(conn, sealed.rows, KeyIds())
        conn.execute(sa.update(pool_epochs).values(durable_seq=sealed.last_seq, head_hash=sealed.head_hash))
    engine.dispose()
    return events, keys[0].key


def test_a_known_epoch_folds_to_its_exact_state(template: Path, tmp_path: Path) -> None:
    path = tmp_path / "known.db"
    shutil.copy(template, path)
    events, key = known_epoch(path)
    folded, replayed = both_audits(f"sqlite:///{path}")
    assert_same(folded, replayed)
    assert (folded.folded, folded.clean) == (True, True)
    kinds = [event.kind.value for event in events]
    assert kinds == ["allocate_for", "register", "share", "allocate_for", "free_all", "release"]
    assert (folded.num_events, folded.last_seq, folded.closed) == (8, 8, False)  # POOL_INIT, 6 events, SNAPSHOT
    state = folded.state
    assert list(state.owners.items()) == [(0, "b"), (2, "b")]  # block 0 passed from "a" to its sharer "b"
    assert state.sharers == {}
    assert state.block_keys == {0: (key, None)}
    assert state.key_blocks == {key: 0}
    assert state.cached_free == []
    assert state.free_block_ids == [*range(NUM_BLOCKS - 1, 2, -1), 1]


def test_a_known_epoch_with_a_wrong_hash_is_left_to_the_python_replay(template: Path, tmp_path: Path) -> None:
    path = tmp_path / "known.db"
    shutil.copy(template, path)
    known_epoch(path)
    engine = create_log_engine(f"sqlite:///{path}")
    with engine.begin() as conn:  # the SNAPSHOT's row (seq 8) stores another hash
        conn.execute(sa.update(allocator_events).where(allocator_events.c.seq == 8).values(hash=b"\0" * 32))
    engine.dispose()
    folded, replayed = both_audits(f"sqlite:///{path}")
    assert_same(folded, replayed)
    assert not folded.folded
    assert [(violation.seq, violation.rule) for violation in folded.violations] == [
        (8, "hash_mismatch"),
        (8, "hash_mismatch"),
    ]


def _head(path: Path) -> bytes:
    engine = create_log_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        head = conn.execute(sa.select(pool_epochs.c.head_hash)).scalar_one()
    engine.dispose()
    return bytes(head)


def test_without_a_compiler_the_audit_replays_in_python(
    template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "known.db"
    shutil.copy(template, path)
    known_epoch(path)
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there
    monkeypatch.setattr(intact_fold_build, "_compiler", lambda: [str(tmp_path / "no-such-cc")])
    monkeypatch.setattr(intact_fold_build, "_state", {})
    assert intact_fold_build.load() is None
    assert intact_fold_build.unavailable_reason().startswith("FileNotFoundError: ")
    report = audit(f"sqlite:///{path}", POOL_ID, 1)
    assert (report.folded, report.clean, report.num_events) == (False, True, 8)
