"""Two logs of one pool id and epoch, written from one process, keep their journals apart.

The journal's table is one per process and kept each epoch's chain head and live
requests by (pool id, epoch) alone: two ``LLM``s in one process, each with its
own SQLite file and the default pool id, chained their journal rows from each
other's heads, and ``nanoserve log audit`` of the first said
``journal records 27..30 altered (hash mismatch)`` of a log nobody touched.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from nanoserve.allocator.log import audit
from nanoserve.engine import LLM, SamplingParams
from nanoserve.engine.journal.records import request_history
from nanoserve.engine.journal.store import audit_journal, read_journal

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_two_llms_with_the_same_pool_id_write_two_clean_journals(tiny_model_dir: Path, tmp_path: Path) -> None:
    urls = [f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db")]
    llms = [
        LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=4, event_log_url=url) for url in urls
    ]
    texts: list[list[list[int]]] = [[], []]
    try:
        for round_number in range(3):  # the two logs' batches interleave
            for index, llm in enumerate(llms):
                prompts = [f"hello there number {round_number}", f"second prompt {round_number}"]
                texts[index] += [list(output.outputs[0].token_ids) for output in llm.generate(prompts, [GREEDY] * 2)]
    finally:
        for llm in llms:
            llm.shutdown()
    assert texts[0] == texts[1]
    for url, tokens in zip(urls, texts, strict=True):
        assert audit(url, "default").clean
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                assert audit_journal(conn, "default") == []
                entries = read_journal(conn, "default")
        finally:
            engine.dispose()
        request_ids = {entry.request_id for entry in entries}
        histories = [
            request_history(((e.epoch, e.kind, e.data) for e in entries if e.request_id == request_id), request_id)
            for request_id in request_ids
        ]
        # each journal names its own six requests, each with the tokens it generated
        assert sorted(history.token_ids for history in histories if history is not None) == sorted(tokens)
