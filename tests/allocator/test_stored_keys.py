"""Stored keys (migration 0009): packed rows name their prefix-cache keys by id, every reader sees the records."""

from __future__ import annotations

import base64
import hashlib
import zlib
from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, BlockTable, FreeReason, extend_block_keys
from nanoserve.allocator.log import EventLog, audit, audit_all, key_refs, packed_rows, read_events, replay, store
from nanoserve.allocator.log import hash_chain_verifier as chain_verifier
from nanoserve.allocator.log.archive import RetentionPolicy, archive_epoch
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.allocator.log.key_refs import KeyChunks, KeyIds, MissingKeys
from nanoserve.allocator.log.reader import connect, event_rows
from nanoserve.allocator.log.segment_archive import LiveSize, archive_due_segment
from nanoserve.migrations import upgrade

BLOCK_SIZE = 2
# the keys of the cached prompt: three full blocks
KEYS = extend_block_keys([], [1, 2, 3, 4, 5, 6], BLOCK_SIZE)
HEX = [key.key for key in KEYS]  # as events name them


def key_text(key: str) -> str:
    """A key as a record writes it: "~" and the unpadded base64url of its 32 bytes."""
    return "~" + base64.urlsafe_b64encode(bytes.fromhex(key)).decode().rstrip("=")


def write_cached(log: EventLog, pool: BlockAllocator) -> None:
    """Three commits: A allocates and registers KEYS; B shares two of them as A releases them all (keys
    first stored by the commit before); B ends and C's allocation evicts them."""
    a = BlockTable(pool, "A")
    a.append_tokens(6)
    a.register(KEYS, 6)
    log.append_batch(1, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    b = BlockTable(pool, "B")
    assert b.share_prefix(KEYS[:2]) == 4
    b.append_tokens(2)
    a.release(FreeReason.FINISHED)
    log.append_batch(2, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    b.release(FreeReason.FINISHED)
    blocks = pool.allocate_for(16, "C")
    log.append_batch(3, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    pool.free_all(blocks, FreeReason.FINISHED)
    log.append_batch(4, pool.take_events(), pool.snapshot)


def cached_log(url: str, pool_id: str) -> BlockAllocator:
    """Seq 1 POOL_INIT; 2..3, 4..6, 7..10 packed rows naming KEYS by id; 11 C's free; 12 POOL_CLOSE."""
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=BLOCK_SIZE)
    pool = BlockAllocator(8, BLOCK_SIZE)
    write_cached(log, pool)
    log.close(final_state=pool.snapshot())
    return pool


def query(url: str, sql: str, **params: object) -> list[tuple[object, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(sql), params)
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


def stored_text(url: str, pool_id: str, seq: int) -> str:
    """A packed row's stored text (its keys named by id)."""
    [(blob,)] = query(url, "SELECT records FROM allocator_events WHERE pool_id = :p AND seq = :s", p=pool_id, s=seq)
    assert isinstance(blob, bytes)
    assert blob[:1] == key_refs.DEFLATED_KEYED_FORMAT
    return zlib.decompress(blob[1:], -15).decode()


def records(url: str, pool_id: str) -> list[tuple[object, ...]]:
    """(seq, kind, owner, record, hash) of every event of epoch 1, as readers get them."""
    with connect(url) as conn:
        return [row for chunk in event_rows(conn, pool_id, 1) for row in chunk]


def test_each_key_is_stored_once_per_epoch_and_records_name_it_by_id(log_url: str, pool_id: str) -> None:
    cached_log(log_url, pool_id)
    keys = query(
        log_url, "SELECT first_key_id, block_keys FROM allocator_keys WHERE pool_id = :p ORDER BY 1", p=pool_id
    )
    assert keys == [(0, b"".join(bytes.fromhex(key) for key in HEX))]  # stored by the first commit, once
    assert [
        row[:2]
        for row in query(
            log_url,
            "SELECT seq, last_seq FROM allocator_events WHERE pool_id = :p AND kind = 'packed' ORDER BY seq",
            p=pool_id,
        )
    ] == [(2, 3), (4, 6), (7, 10)]
    second = stored_text(log_url, pool_id, 4)  # keys first stored by the row before
    assert "~" not in second
    assert ";\x1f0=2,\x1f1=2|" in second  # B's SHARE of keys 0 and 1


def test_records_read_back_are_the_records_the_chain_covers(log_url: str, pool_id: str) -> None:
    pool = cached_log(log_url, pool_id)
    events = read_events(log_url, pool_id)
    assert [event.kind for event in events] == [
        "pool_init",
        "allocate_for",
        "register",
        "share",
        "allocate_for",
        "release",
        "free_all",
        "release",
        "evict",
        "allocate_for",
        "free_all",
        "pool_close",
    ]
    assert events[3].keys == tuple(HEX[:2])
    rows = records(log_url, pool_id)
    assert f";{key_text(HEX[0])}=2,{key_text(HEX[1])}=2|" in str(rows[3][3])
    previous = genesis_hash(pool_id, 1)
    for (_, _, _, record, hash_), event in zip(rows, events, strict=True):
        assert isinstance(record, str)
        previous = hashlib.sha256(previous + record.encode()).digest()
        assert hash_ == event.hash == previous
    report = audit(log_url, pool_id)
    assert (report.clean, report.closed, report.num_events) == (True, True, 12)
    assert replay(log_url, pool_id) == pool.state()
    assert replay(log_url, pool_id, until_seq=5).cached_free == []


def test_any_text_comes_back_exactly() -> None:
    key = key_text(HEX[0])
    texts = [
        f"4|6|share|0|2|;{key}=2|1|2|A",
        f"owner with a marker \x1f and \x1f\x1f7 and {key}\x1f{key}",
        f"{key}A is no key (44 base64url characters), {key[:-1]}Z= is none either",
        f"~{'A' * 42}B: not the canonical text of 32 bytes",
        "",
    ]
    ids = KeyIds()
    referred = [ids.refer(text) for text in texts]
    assert referred[0] == "4|6|share|0|2|;\x1f0=2|1|2|A"
    assert referred[2] == texts[2]
    assert referred[3] == texts[3]
    staged = ids.staged_row()
    assert staged == (0, bytes.fromhex(HEX[0]))
    chunks = KeyChunks()
    chunks.add(*staged)
    assert [chunks.expand(text) for text in referred] == texts


def test_a_key_first_stored_in_an_earlier_row_is_named_by_its_id() -> None:
    first = [row(2, f"register|0|1|;{key_text(HEX[0])}::AQI,{key_text(HEX[1])}:^:AwQ"), row(3, "allocate|1|1|")]
    second = [row(4, f"release|0|2|finished;{key_text(HEX[1])}=0,{key_text(HEX[2])}=1"), row(5, "free|1|2|")]
    ids = KeyIds()
    ids.begin()
    assert [row[3] for row in packed_rows.pack_rows(first, ids)] == ["packed"]
    staged_first = ids.staged_row()
    ids.commit()
    ids.begin()
    [packed_second] = packed_rows.pack_rows(second, ids)
    staged_second = ids.staged_row()
    assert staged_first == (0, bytes.fromhex(HEX[0]) + bytes.fromhex(HEX[1]))
    assert staged_second == (2, bytes.fromhex(HEX[2]))
    assert b"\x1f1=0,\x1f2=1" in zlib.decompress(packed_second[9][1:], -15)
    chunks = KeyChunks()
    for staged in (staged_first, staged_second):
        assert staged is not None
        chunks.add(*staged)
    assert packed_rows.unpack_records(4, 5, packed_second[9], chunks) == [r[5] for r in second]
    previous = b"h3"
    expanded = packed_rows.expand_packed(4, 5, packed_second[9], packed_second[6], previous, chunks)
    assert [r[3] for r in expanded] == [r[5] for r in second]
    assert expanded[0][4] == hashlib.sha256(previous + second[0][5].encode()).digest()
    # the verifier process turns ids back into keys the same way
    assert chain_verifier._packed_records(4, 5, packed_second[9], chunks) == [r[5].encode() for r in second]
    # a reader without the row that stores key 2 cannot read the packed row, and says why
    without = KeyChunks()
    without.add(*staged_first)  # type: ignore[misc]
    with pytest.raises(MissingKeys, match=r"records name key id\(s\) 2, which no allocator_keys row holds"):
        packed_rows.unpack_records(4, 5, packed_second[9], without)
    assert chain_verifier._packed_records(4, 5, packed_second[9], without) is None


def row(seq: int, fields: str) -> tuple[object, ...]:
    """An event row (store.ROW_COLUMNS) whose record is ``seq|batch|kind|blocks|step|reason`` + times + owner."""
    kind, rest = fields.split("|", 1)
    return ("p", 1, seq, kind, "A", f"{seq}|5|{kind}|{rest}|7|8|A", bytes([seq]), None)


def test_a_failed_commit_leaves_no_key_id_behind_and_its_retry_stores_the_same(
    log_url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = EventLog.open(log_url, pool_id=pool_id, num_blocks=8, block_size=BLOCK_SIZE)
    writer = log._writer
    real_insert_keys = store.insert_keys
    failures: list[int] = []

    def fail_after_the_keys(conn: sa.Connection, pool: str, epoch: int, first_key_id: int, keys: bytes) -> None:
        real_insert_keys(conn, pool, epoch, first_key_id, keys)  # in the transaction, which then fails
        if len(failures) < 2:
            failures.append(first_key_id)
            raise sa.exc.OperationalError("INSERT", {}, Exception("disk I/O error (test)"))

    monkeypatch.setattr(store, "insert_keys", fail_after_the_keys)
    pool = BlockAllocator(8, BLOCK_SIZE)
    write_cached(log, pool)
    log.close(final_state=pool.snapshot())
    assert failures == [0, 0]  # the first commit with keys failed twice after storing them, then went through
    assert writer.num_retries == 2
    assert query(log_url, "SELECT first_key_id FROM allocator_keys WHERE pool_id = :p", p=pool_id) == [(0,)]
    assert audit(log_url, pool_id).clean
    assert [event.keys for event in read_events(log_url, pool_id, kind="evict")] == [tuple(reversed(HEX))]


def test_a_lost_acknowledgement_keeps_the_ids_its_commit_stored(
    log_url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = EventLog.open(log_url, pool_id=pool_id, num_blocks=8, block_size=BLOCK_SIZE)
    writer = log._writer
    real_commit = writer._commit
    calls: list[int] = []

    def commit_then_lose_ack(rows: list, last_seq: int, head_hash: bytes, closed_seq: int | None) -> None:  # type: ignore[type-arg]
        calls.append(last_seq)
        real_commit(rows, last_seq, head_hash, closed_seq)
        if len(calls) == 1:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection lost after commit (test)"))

    monkeypatch.setattr(writer, "_commit", commit_then_lose_ack)
    pool = BlockAllocator(8, BLOCK_SIZE)
    write_cached(log, pool)
    # a key the next commit stores first takes the next id, not one the lost commit stored
    more = extend_block_keys([], [7, 8], BLOCK_SIZE)
    d = BlockTable(pool, "D")
    d.append_tokens(2)
    d.register(more, 2)
    d.release(FreeReason.FINISHED)
    log.append_batch(5, pool.take_events(), pool.snapshot)
    log.close(final_state=pool.snapshot())
    assert calls[:2] == [3, 3]  # the retry found the first commit of keys stored
    assert query(log_url, "SELECT first_key_id FROM allocator_keys WHERE pool_id = :p ORDER BY 1", p=pool_id) == [
        (0,),
        (3,),
    ]
    assert audit(log_url, pool_id).clean
    [register] = read_events(log_url, pool_id, kind="register", from_seq=12)
    assert register.keys == tuple(key.key for key in more)


def test_a_missing_key_row_is_named_by_audit_with_the_seqs_that_name_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nanoserve.service.cli.main import main

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    cached_log(url, "p")
    query(url, "DELETE FROM allocator_keys")
    report = audit(url, "p")
    bad = [(v.seq, v.message) for v in report.violations if v.rule == "bad_record"]
    assert bad == [
        (2, "seqs 2..3 (one packed row): records name key id(s) 0, 1, 2, which no allocator_keys row holds"),
        (4, "seqs 4..6 (one packed row): records name key id(s) 0, 1, 2, which no allocator_keys row holds"),
        (7, "seqs 7..10 (one packed row): records name key id(s) 0, 1, 2, which no allocator_keys row holds"),
    ]
    assert main(["log", "audit", "--url", url]) == 1
    assert "seq 4: bad_record: seqs 4..6 (one packed row): " in capsys.readouterr().out
    assert main(["log", "show", "--url", url]) == 1
    assert "damaged: seq 2: seqs 2..3 (one packed row): " in capsys.readouterr().out


def test_an_altered_key_row_fails_the_hash_of_each_row_that_names_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    cached_log(url, "p")
    [(stored,)] = query(url, "SELECT block_keys FROM allocator_keys")
    assert isinstance(stored, bytes)
    query(url, "UPDATE allocator_keys SET block_keys = :b", b=stored[:40] + bytes([stored[40] ^ 1]) + stored[41:])
    report = audit(url, "p")
    # key 1 (bytes 32..63) is named by each packed row: each fails at its last seq, named with its seqs
    altered = "one of its records, or a key it names by id (allocator_keys), changed)"
    assert [(v.seq, v.rule, v.message) for v in report.violations if v.rule == "hash_mismatch"] == [
        (seq, "hash_mismatch", f"stored hash does not match the record and the previous hash (seqs {seqs}: {altered}")
        for seq, seqs in (
            (3, "2..3 are one packed row"),
            (6, "4..6 are one packed row"),
            (10, "7..10 are one packed row"),
        )
    ]


def test_downgrading_below_0009_writes_the_keys_back_into_the_records(tmp_path: Path) -> None:
    from alembic import command

    from nanoserve.migrations import alembic_config

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    pool = cached_log(url, "p")
    events = read_events(url, "p")
    rows = records(url, "p")
    command.downgrade(alembic_config(url), "0008")
    tables = [name for (name,) in query(url, "SELECT name FROM sqlite_master WHERE type = 'table'")]
    assert "allocator_keys" not in tables
    [(blob,)] = query(url, "SELECT records FROM allocator_events WHERE seq = 4")
    assert isinstance(blob, bytes)
    assert zlib.decompress(blob).decode().split("\n") == [row[3] for row in rows[3:6]]  # the 0008 form
    assert read_events(url, "p") == events
    upgrade(url)
    assert audit(url, "p").clean
    assert replay(url, "p") == pool.state()


class Cached:
    """An open epoch whose every request shares KEYS (registered by the first): a SNAPSHOT every 10 events."""

    def __init__(self, url: str, pool_id: str) -> None:
        self.log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=BLOCK_SIZE, num_events_per_snapshot=10)
        self.pool = BlockAllocator(8, BLOCK_SIZE)
        first = BlockTable(self.pool, "first")
        first.append_tokens(6)
        first.register(KEYS, 6)
        first.release(FreeReason.FINISHED)
        self.log.append_batch(None, self.pool.take_events(), self.pool.snapshot)
        self.num_requests = 0

    def run(self, num_requests: int) -> None:
        for _ in range(num_requests):
            table = BlockTable(self.pool, f"r{self.num_requests}")
            table.share_prefix(KEYS)
            table.append_tokens(1)
            table.release(FreeReason.FINISHED)
            self.log.append_batch(None, self.pool.take_events(), self.pool.snapshot)
            self.num_requests += 1
        self.log.flush()


def test_a_segment_file_carries_the_keys_stored_before_its_cut(log_url: str, pool_id: str, tmp_path: Path) -> None:
    cached = Cached(log_url, pool_id)
    cached.run(10)
    size = LiveSize()
    policy = RetentionPolicy(retention_bytes=300)
    [first] = archive_due_segment(log_url, tmp_path / "arch", policy, upgrade, pool_id, size)
    cached.run(10)  # names the keys stored before the first cut
    [second] = archive_due_segment(log_url, tmp_path / "arch", policy, upgrade, pool_id, size)
    cached.run(2)
    assert first.last_seq < second.first_seq
    for entry in (first, second):
        archive_url = f"sqlite:///{entry.path}"
        [report] = audit_all(archive_url)  # the file alone
        assert (report.clean, report.from_seq) == (True, entry.first_seq)
        assert query(archive_url, "SELECT first_key_id FROM allocator_keys") == [(0,)]
        shares = read_events(archive_url, pool_id, kind="share")
        assert shares
        assert {event.keys for event in shares} == {tuple(HEX)}
    assert audit(log_url, pool_id).clean  # the live rows name the keys stored before both cuts
    cached.log.close(final_state=cached.pool.snapshot())
    assert audit(log_url, pool_id).clean


def test_an_archived_epoch_takes_its_keys_with_it(log_url: str, pool_id: str, tmp_path: Path) -> None:
    cached_log(log_url, pool_id)
    records_before = records(log_url, pool_id)
    EventLog.open(log_url, pool_id=pool_id, num_blocks=8, block_size=BLOCK_SIZE).close()  # epoch 2
    engine = sa.create_engine(log_url)
    try:
        entry = archive_epoch(engine, pool_id, 1, tmp_path / "epochs", upgrade)
    finally:
        engine.dispose()
    assert query(log_url, "SELECT epoch FROM allocator_keys WHERE pool_id = :p", p=pool_id) == []
    archive_url = f"sqlite:///{entry.path}"
    [report] = audit_all(archive_url)
    assert (report.clean, report.num_events) == (True, 12)
    assert records(archive_url, pool_id) == records_before


def test_a_lone_event_naming_keys_is_a_packed_row_and_one_naming_none_stays_a_row() -> None:
    register = row(2, f"register|0|1|;{key_text(HEX[0])}::AQI")
    allocate = row(3, "allocate|1|1|")
    ids = KeyIds()
    stored = packed_rows.pack_rows([register], ids)
    assert [(r[2], r[3], r[8]) for r in stored] == [(2, "packed", 2)]
    assert stored[0][6] == register[6]  # its hash: the event's
    assert packed_rows.pack_rows([allocate], ids) == [(*allocate, None, None)]
    assert packed_rows.pack_rows([register]) == [(*register, None, None)]  # a log without stored keys
    chunks = KeyChunks()
    chunks.add(*ids.staged_row())  # type: ignore[misc]
    expanded = packed_rows.expand_packed(2, 2, stored[0][9], stored[0][6], b"h1", chunks)
    assert expanded == [(2, "register", "A", register[5], register[6])]


def test_a_key_the_writer_forgot_is_stored_again_under_a_new_id() -> None:
    ids = KeyIds(num_keys_held=2)
    other = extend_block_keys([], [9, 9], BLOCK_SIZE)[0].key
    named = [HEX[0], HEX[1], HEX[2], other, HEX[0]]
    texts = [f"{index};{key_text(key)}" for index, key in enumerate(named)]
    chunks = KeyChunks()
    referred = []
    for text in texts:
        ids.begin()
        referred.append(ids.refer(text))
        staged = ids.staged_row()
        if staged is not None:
            chunks.add(*staged)
        ids.commit()
    # keys 0 and 1 filled a generation, keys 2 and 3 the next: key 0, named by neither since, is forgotten
    assert referred == ["0;\x1f0", "1;\x1f1", "2;\x1f2", "3;\x1f3", "4;\x1f4"]
    assert [chunks.expand(text) for text in referred] == texts
    assert len(ids) == 5


def test_the_verifier_process_verifies_rows_that_name_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from .conftest import replay_module

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    pool = cached_log(url, "p")
    monkeypatch.setattr(replay_module, "NUM_EVENTS_FOR_VERIFIER", 1)
    monkeypatch.setattr(replay_module, "_has_idle_core", lambda: True)
    verdicts: list[chain_verifier.ChainResult | None] = []
    real_result = chain_verifier.result

    def kept(proc: object) -> chain_verifier.ChainResult | None:
        verdict = real_result(proc)  # type: ignore[arg-type]
        verdicts.append(verdict)
        return verdict

    monkeypatch.setattr(chain_verifier, "result", kept)
    assert replay(url, "p", from_snapshot=False) == pool.state()
    assert [(v.intact, v.num_rows) if v else None for v in verdicts] == [(True, 12)]


def test_many_new_keys_of_one_commit_are_cut_into_rows_and_read_back(
    log_url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("nanoserve.allocator.log.key_table.MAX_KEYS_PER_ROW", 2)
    pool = cached_log(log_url, pool_id)
    stored = query(
        log_url, "SELECT first_key_id, block_keys FROM allocator_keys WHERE pool_id = :p ORDER BY 1", p=pool_id
    )
    assert stored == [(0, bytes.fromhex(HEX[0]) + bytes.fromhex(HEX[1])), (2, bytes.fromhex(HEX[2]))]
    assert audit(log_url, pool_id).clean
    assert replay(log_url, pool_id) == pool.state()
    assert [event.keys for event in read_events(log_url, pool_id, kind="evict")] == [tuple(reversed(HEX))]


def zlib_keyed(blob: bytes) -> bytes:
    """A packed row's blob as 0009 first wrote it: byte 1, then a zlib stream of the same text."""
    assert blob[:1] == key_refs.DEFLATED_KEYED_FORMAT
    return key_refs.KEYED_FORMAT + zlib.compress(zlib.decompress(blob[1:], -15), 6)


def test_a_packed_row_naming_keys_is_raw_deflate_six_bytes_under_its_zlib_form() -> None:
    rows = [row(2, f"register|0|1|;{key_text(HEX[0])}::AQI,{key_text(HEX[1])}:^:AwQ"), row(3, "allocate|1|1|")]
    ids = KeyIds()
    ids.begin()
    [packed] = packed_rows.pack_rows(rows, ids)
    blob = packed[9]
    assert blob[:1] == b"\x02"
    assert b"register|0|1|;\x1f0::AQI,\x1f1:^:AwQ" in zlib.decompress(blob[1:], -15)
    assert len(zlib_keyed(blob)) == len(blob) + 6  # zlib's header and Adler-32
    chunks = KeyChunks()
    chunks.add(*ids.staged_row())  # type: ignore[misc]
    assert packed_rows.unpack_records(2, 3, blob, chunks) == [r[5] for r in rows]
    assert packed_rows.unpack_records(2, 3, zlib_keyed(blob), chunks) == [r[5] for r in rows]
    for form in (blob, zlib_keyed(blob)):  # the verifier process reads both forms the same way
        assert chain_verifier._packed_records(2, 3, form, chunks) == [r[5].encode() for r in rows]
        assert packed_rows.key_ids_of(form) == {0, 1}


def test_rows_of_the_zlib_keyed_form_still_read_audit_and_downgrade(tmp_path: Path) -> None:
    from alembic import command

    from nanoserve.migrations import alembic_config

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    cached_log(url, "p")
    events, rows = read_events(url, "p"), records(url, "p")
    [(blob,)] = query(url, "SELECT records FROM allocator_events WHERE seq = 4")
    assert isinstance(blob, bytes)
    query(url, "UPDATE allocator_events SET records = :b WHERE seq = 4", b=zlib_keyed(blob))  # as 0009 wrote it
    assert read_events(url, "p") == events
    assert records(url, "p") == rows
    assert audit(url, "p").clean
    command.downgrade(alembic_config(url), "0008")  # both forms get their keys back in their records
    for seq, last in ((2, 3), (4, 6), (7, 10)):
        [(inlined,)] = query(url, "SELECT records FROM allocator_events WHERE seq = :s", s=seq)
        assert isinstance(inlined, bytes)
        assert zlib.decompress(inlined).decode().split("\n") == [r[3] for r in rows[seq - 1 : last]]
    assert read_events(url, "p") == events


def test_a_raw_deflated_row_altered_is_a_hash_mismatch_and_one_cut_does_not_inflate(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    cached_log(url, "p")
    text = stored_text(url, "p", 4)
    assert "=0" in text
    # no checksum in the stream: a changed record inflates, and the chain's hash at the row's last seq fails
    altered = key_refs.deflate_records(text.replace("=0", "=1", 1))
    query(url, "UPDATE allocator_events SET records = :b WHERE seq = 4", b=altered)
    report = audit(url, "p")
    assert [v.seq for v in report.violations if v.rule == "hash_mismatch"] == [6]
    [(blob,)] = query(url, "SELECT records FROM allocator_events WHERE seq = 7")
    assert isinstance(blob, bytes)
    query(url, "UPDATE allocator_events SET records = :b WHERE seq = 7", b=blob[:-2])
    bad = [(v.seq, v.message) for v in audit(url, "p").violations if v.rule == "bad_record"]
    assert bad == [
        (
            7,
            "seqs 7..10 (one packed row): records do not inflate "
            "(raw deflate stream cut short or followed by other bytes)",
        )
    ]


def parent_log(url: str, pool_id: str) -> list[tuple[object, ...]]:
    """A registers two blocks, then (a commit later) the third, whose parent's key the record writes without
    its "~" (``~KEY:PARENT:TOKENS``); then releases them. The records of epoch 1, as readers get them."""
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=BLOCK_SIZE)
    pool = BlockAllocator(8, BLOCK_SIZE)
    a = BlockTable(pool, "A")
    a.append_tokens(4)
    a.register(KEYS[:2], 4)
    log.append_batch(1, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    a.append_tokens(2)
    a.register(KEYS, 6)
    log.append_batch(2, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    a.release(FreeReason.FINISHED)
    log.append_batch(3, pool.take_events(), pool.snapshot)
    log.close(final_state=pool.snapshot())
    return records(url, pool_id)


def test_a_registers_parent_key_is_named_by_its_id_too(log_url: str, pool_id: str) -> None:
    rows = parent_log(log_url, pool_id)
    register = str(rows[4][3])
    assert f";{key_text(HEX[2])}:{key_text(HEX[1])[1:]}:" in register  # the parent: no "~"
    [(seq,)] = query(
        log_url, "SELECT seq FROM allocator_events WHERE pool_id = :p AND seq <= 5 AND last_seq >= 5", p=pool_id
    )
    packed = stored_text(log_url, pool_id, int(seq))  # type: ignore[call-overload]
    assert ";\x1f2:\x1f^1:" in packed  # about 5 bytes where the parent's 43 random characters were
    keys = query(
        log_url, "SELECT first_key_id, block_keys FROM allocator_keys WHERE pool_id = :p ORDER BY 1", p=pool_id
    )
    assert keys == [(0, bytes.fromhex(HEX[0]) + bytes.fromhex(HEX[1])), (2, bytes.fromhex(HEX[2]))]
    report = audit(log_url, pool_id)
    assert (report.clean, report.num_events) == (True, len(rows))


def test_a_bare_key_comes_back_exactly_and_downgrades_into_its_record(tmp_path: Path) -> None:
    from alembic import command

    from nanoserve.migrations import alembic_config

    bare = key_text(HEX[0])[1:]
    texts = [f"x:{bare}:y", f"x:{bare}", f"{bare}:y", f"::{bare}::{bare}A:", f"x:~{bare}:{bare}:z"]
    ids = KeyIds()
    referred = [ids.refer(text) for text in texts]
    assert referred == ["x:\x1f^0:y", texts[1], texts[2], f"::\x1f^0::{bare}A:", "x:\x1f0:\x1f^0:z"]
    chunks = KeyChunks()
    chunks.add(*ids.staged_row())  # type: ignore[misc]
    assert [chunks.expand(text) for text in referred] == texts
    assert key_refs.referenced_ids(referred[4]) == {0}
    with pytest.raises(MissingKeys, match=r"key id\(s\) 0,"):
        KeyChunks().expand(referred[0])

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    rows = parent_log(url, "p")
    events = read_events(url, "p")
    command.downgrade(alembic_config(url), "0008")
    assert records(url, "p") == rows
    assert read_events(url, "p") == events
