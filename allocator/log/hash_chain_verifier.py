"""Hash-chain verification of stored rows in a second process.

Record ``i`` of an epoch is intact iff ``sha256(stored_hash[i-1] + record[i])
== stored_hash[i]``: with the stored hashes in hand each record is checked on
its own, so the chain can be verified beside the replay instead of inside it.
``start`` launches this module as a script (``python -I chain_verifier.py``)
that reads the rows of one seq range from the SQLite file with its own
connection and prints one JSON line; ``result`` collects it. The replay
process meanwhile applies the same rows to the pool state, and takes the
verdict before it trusts them (see ``replay``).

The script imports only the standard library (no SQLAlchemy, no nanoserve),
so it starts in milliseconds; the caller hands it the compiled SQL. It
therefore reads packed rows itself (``_packed_records``: what
``packed_rows.unpack_records`` does, a test holds the two alike), inflating
them and turning back the keys of a row that names them by id (read with
the SQL it is handed) with ``key_refs``, a standard-library module it loads
by path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import operator
import sqlite3
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_digest = operator.methodcaller("digest")
# columns of a (seq, record, hash) row, taken out of a whole chunk at C speed
_seq_of, _record_of, _hash_of = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)
_FETCH_ROWS = 1_000  # small chunks stay in the CPU caches
_last_seq_of = operator.itemgetter(3)


@dataclass(frozen=True)
class ChainResult:
    """What the verifier saw: ``num_rows`` rows with seqs from_seq, from_seq + 1, ...

    intact: every seq in line and every stored hash equal to
        sha256(previous stored hash + record).
    last_hash: stored hash of the last row (the chain's head), None without rows.
    """

    intact: bool
    num_rows: int
    last_hash: bytes | None


def verify_rows(cursor: sqlite3.Cursor, previous_hash: bytes, from_seq: int, keys: Any = None) -> ChainResult:
    """Check the rows ``(seq, record as UTF-8 bytes, hash, last_seq, records)`` left in ``cursor``, in seq
    order; a packed row (``last_seq`` not NULL) counts as its events. ``keys``: the epoch's stored keys
    (a ``key_refs.KeyChunks``), which a packed row naming its keys by id needs (None: such a row fails)."""
    previous = previous_hash
    expected = from_seq
    num_rows = 0
    while stored := cursor.fetchmany(_FETCH_ROWS):
        chunk = (
            stored if list(map(_last_seq_of, stored)).count(None) == len(stored) else _expanded(stored, previous, keys)
        )
        if chunk is None:
            return ChainResult(False, num_rows, None)
        if list(map(_seq_of, chunk)) != list(range(expected, expected + len(chunk))):
            return ChainResult(False, num_rows, None)
        hashes = list(map(_hash_of, chunk))
        chained = [previous]
        chained += hashes[:-1]
        computed = list(map(_digest, map(hashlib.sha256, map(operator.add, chained, map(_record_of, chunk)))))
        if computed != hashes:
            return ChainResult(False, num_rows, None)
        previous = hashes[-1]
        expected += len(chunk)
        num_rows += len(chunk)
    return ChainResult(True, num_rows, previous if num_rows else None)


def _expanded(stored: list[Any], previous: bytes, keys: Any) -> list[tuple[Any, ...]] | None:
    """(seq, record, hash) per event of stored rows, packed ones chained from the row before; None when
    a packed row cannot be read."""
    rows: list[tuple[Any, ...]] = []
    for seq, record, stored_hash, last_seq, blob in stored:
        if last_seq is None:
            rows.append((seq, record, stored_hash))
        else:
            records = _packed_records(seq, last_seq, blob, keys)
            if records is None:
                return None
            for offset, packed in enumerate(records[:-1]):
                previous = hashlib.sha256(previous + packed).digest()
                rows.append((seq + offset, packed, previous))
            rows.append((last_seq, records[-1], stored_hash))
        previous = stored_hash
    return rows


def _packed_records(first_seq: int, last_seq: Any, blob: Any, keys: Any = None) -> list[bytes] | None:
    """A packed row's records as UTF-8 bytes (``packed_rows``); None when they cannot be read."""
    try:
        keyed, raw = _key_refs().inflate_records(blob)
        if keyed:
            if keys is None:
                return None
            records = keys.expand(raw.decode()).encode().split(b"\n")
        else:
            records = raw.split(b"\n")
        for record in records:
            record.decode()
    except (zlib.error, TypeError, ValueError):  # ValueError: UnicodeDecodeError, key_refs.MissingKeys
        return None
    return records if type(last_seq) is int and len(records) == last_seq - first_seq + 1 else None


def start(
    database: str,
    sql: str,
    params: list[Any],
    previous_hash: bytes,
    from_seq: int,
    keys_sql: str | None = None,
    keys_params: list[Any] | None = None,
) -> subprocess.Popen[str]:
    """Launch the verifier on an SQLite file; ``sql`` selects (seq, record as BLOB, hash, last_seq, records)
    in seq order, ``keys_sql`` (None: a log without stored keys) the epoch's (first_key_id, block_keys)."""
    request = {
        "database": database,
        "sql": sql,
        "params": params,
        "keys_sql": keys_sql,
        "keys_params": keys_params or [],
        "previous_hash": previous_hash.hex(),
        "from_seq": from_seq,
    }
    return subprocess.Popen(
        [sys.executable, "-I", __file__, json.dumps(request)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen[str]) -> ChainResult | None:
    """The verdict of a started verifier; None when it failed (the caller then checks in-process)."""
    out, _ = proc.communicate()
    if proc.returncode != 0:
        return None
    try:
        answer = json.loads(out)
        last_hash = None if answer["last_hash"] is None else bytes.fromhex(answer["last_hash"])
        return ChainResult(bool(answer["intact"]), int(answer["num_rows"]), last_hash)
    except (ValueError, KeyError, TypeError):
        return None


@functools.cache
def _key_refs() -> Any:
    """``key_refs``, loaded by its path (this script imports no nanoserve package)."""
    spec = importlib.util.spec_from_file_location("nanoserve_key_refs", Path(__file__).with_name("key_refs.py"))
    assert spec is not None, "key_refs.py lies beside this file"
    assert spec.loader is not None, "a source file has a loader"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass-free classes still resolve their module
    spec.loader.exec_module(module)
    return module


def _main() -> int:
    request = json.loads(sys.argv[1])
    connection = sqlite3.connect(request["database"])
    try:
        keys = None
        if request.get("keys_sql"):
            keys = _key_refs().KeyChunks()
            for first_key_id, stored in connection.execute(request["keys_sql"], request["keys_params"]):
                keys.add(first_key_id, stored)
        cursor = connection.execute(request["sql"], request["params"])
        verdict = verify_rows(cursor, bytes.fromhex(request["previous_hash"]), request["from_seq"], keys)
    finally:
        connection.close()
    last_hash = None if verdict.last_hash is None else verdict.last_hash.hex()
    print(json.dumps({"intact": verdict.intact, "num_rows": verdict.num_rows, "last_hash": last_hash}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
