"""Stored keys: allocator_keys (the prefix-cache keys of an epoch's packed rows, each stored once).

Adds ``allocator_keys`` (pool_id, epoch, first_key_id, block_keys): the keys
one group commit stores first in its epoch, 32 bytes each back to back, key
ids ``first_key_id, first_key_id + 1, ...``. A packed row written after it
may name its keys by id (``allocator.log.key_refs``): its ``records`` blob is
byte 1 then the zlib of its records with each ``~`` + base64url key written
``\\x1f`` + key id (and a ``\\x1f`` of the text written twice); later
nanoserve writes byte 2 then the raw deflate of that text, where a REGISTER's
parent key (written without ``~``) is named ``\\x1f^`` + key id too. Rows written
before keep their form (a zlib stream begins with 0x78) and read as they are;
an older nanoserve reading such a row finds it unreadable (it does not
inflate) rather than wrong.

Downgrading writes each such row's keys back into its records (the 0008
form: zlib of the record lines, exactly the text the chain covers), then
drops the table; a key id no row holds stops the downgrade, naming the row.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 05:00:00
"""

from __future__ import annotations

import base64
import re
import zlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_KEYED_FORMAT = b"\x01"  # then a zlib stream
_DEFLATED_KEYED_FORMAT = b"\x02"  # then a raw deflate stream (written since, ``key_refs.deflate_records``)
_KEY_BYTES = 32
_REF = re.compile("\x1f(\x1f|\\^?[0-9]+)")  # "^": a key written without its "~" (byte 2 rows only)


def upgrade() -> None:
    op.create_table(
        "allocator_keys",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("first_key_id", sa.BigInteger(), nullable=False),
        sa.Column("block_keys", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["pool_id", "epoch"],
            ["pool_epochs.pool_id", "pool_epochs.epoch"],
            name=op.f("fk_allocator_keys_pool_id_pool_epochs"),
        ),
        sa.PrimaryKeyConstraint("pool_id", "epoch", "first_key_id", name=op.f("pk_allocator_keys")),
        sqlite_with_rowid=False,  # stored by its key: no index beside the table repeats it
    )


def downgrade() -> None:
    _inline_keys()
    op.drop_table("allocator_keys")


def _inline_keys() -> None:
    """Rewrite each packed row that names its keys by id into the 0008 form, its keys in its records."""
    conn = op.get_bind()
    events = sa.table(
        "allocator_events",
        sa.column("pool_id"),
        sa.column("epoch"),
        sa.column("seq"),
        sa.column("records", sa.LargeBinary()),
    )
    keys = sa.table(
        "allocator_keys",
        sa.column("pool_id"),
        sa.column("epoch"),
        sa.column("first_key_id"),
        sa.column("block_keys", sa.LargeBinary()),
    )
    texts: dict[tuple[str, int], dict[str, str]] = {}  # (pool_id, epoch) -> key id as written -> key text
    packed = conn.execute(
        sa.select(events.c.pool_id, events.c.epoch, events.c.seq, events.c.records)
        .where(events.c.records.is_not(None))
        .order_by(events.c.pool_id, events.c.epoch, events.c.seq)
    )
    for pool_id, epoch, seq, blob in packed.fetchall():
        form, stream = bytes(blob[:1]), bytes(blob)[1:]
        if form not in (_KEYED_FORMAT, _DEFLATED_KEYED_FORMAT):
            continue
        if (pool_id, epoch) not in texts:
            texts[(pool_id, epoch)] = _key_texts(conn, keys, pool_id, epoch)
        where = f"packed row at seq {seq} of pool {pool_id!r} epoch {epoch}"
        packed_text = zlib.decompress(stream, -15 if form == _DEFLATED_KEYED_FORMAT else zlib.MAX_WBITS).decode()
        records = _inlined(packed_text, texts[(pool_id, epoch)], where)
        conn.execute(
            sa.update(events)
            .where(events.c.pool_id == pool_id, events.c.epoch == epoch, events.c.seq == seq)
            .values(records=zlib.compress(records.encode(), 6))
        )


def _inlined(text: str, texts: dict[str, str], where: str) -> str:
    """Packed text with each key id replaced by its key and each doubled marker by one."""

    def text_of(match: re.Match[str]) -> str:
        key_id = match.group(1)
        if key_id == "\x1f":
            return key_id
        bare = key_id.startswith("^")
        key_id = key_id.removeprefix("^")
        if key_id not in texts:
            raise RuntimeError(f"{where} names key id {key_id}, which no allocator_keys row holds")
        return texts[key_id][1:] if bare else texts[key_id]

    return _REF.sub(text_of, text)


def _key_texts(conn: sa.Connection, keys: sa.TableClause, pool_id: str, epoch: int) -> dict[str, str]:
    """key id as written -> "~" + base64url of the key, for one epoch's stored keys."""
    texts = {}
    query = sa.select(keys.c.first_key_id, keys.c.block_keys).where(keys.c.pool_id == pool_id, keys.c.epoch == epoch)
    for first_key_id, stored in conn.execute(query):
        stored = bytes(stored)
        for index in range(len(stored) // _KEY_BYTES):
            key = stored[index * _KEY_BYTES : (index + 1) * _KEY_BYTES]
            texts[str(first_key_id + index)] = "~" + base64.urlsafe_b64encode(key).decode().rstrip("=")
    return texts
