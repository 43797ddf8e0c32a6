"""What the event log stores per generated token, in process on the real model.

The workload of issue 30: chat requests (``--num-requests``, 200) with 64-256
new tokens each (greedy, ignore_eos), half of them sharing one system prompt
of about 1,370 tokens, ``--max-num-seqs`` (32) at a time, through an ``LLM``
with an SQLite event log in a temp folder and the defaults (prefix caching on,
the request journal on). Run twice: without logprobs, and with ``logprobs=20``.

Printed per run: generated tokens; the log's bytes per generated token (the
SQLite file, WAL checkpointed, less an empty migrated log's); each table's rows
and bytes per token (its pages, indexes included, from SQLite's ``dbstat`` when
the build has it); events and journal rows per token. Targets (issue 30):
defaults <= 32 B/token, logprobs=20 <= 200 B/token.

    .venv/bin/python -m bench.log_bytes                      # the issue's 200 requests
    .venv/bin/python -m bench.log_bytes --num-requests 24    # a quick look (about a minute)
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import tempfile
import time
from pathlib import Path

from nanoserve.engine import LLM, SamplingParams
from nanoserve.engine.text.prompts import ChatPrompt
from nanoserve.migrations import upgrade

WORDS = [
    "the",
    "model",
    "answers",
    "every",
    "question",
    "about",
    "blocks",
    "pages",
    "caches",
    "logs",
    "tokens",
    "requests",
    "servers",
    "epochs",
    "hashes",
    "records",
    "steps",
    "prompts",
    "outputs",
    "engines",
    "schedulers",
    "kernels",
    "weights",
    "layers",
    "heads",
    "values",
    "keys",
    "queries",
    "batches",
    "streams",
    "replicas",
    "gateways",
    "journals",
    "audits",
    "chains",
    "rows",
    "tables",
    "indexes",
    "bytes",
]
TABLES = ("allocator_events", "allocator_keys", "journal_steps", "journal_requests", "request_journal", "pool_epochs")


def workload(num_requests: int, system_words: int, seed: int) -> list[tuple[ChatPrompt, int]]:
    """(prompt, max_tokens) per request: even ones share the system prompt, odd ones have their own short one."""
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(system_words))
    requests = []
    for i in range(num_requests):
        system = shared if i % 2 == 0 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        requests.append((ChatPrompt(messages), rng.randint(64, 256)))
    return requests


def stored_bytes(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(file bytes in use, table -> (rows, bytes of its pages and its indexes' pages)); -1 bytes without dbstat."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        in_use = conn.execute("PRAGMA page_count").fetchone()[0] - conn.execute("PRAGMA freelist_count").fetchone()[0]
        pages: dict[str, int] = {}
        try:
            for table, size in conn.execute(
                "SELECT m.tbl_name, SUM(d.pgsize) FROM dbstat d JOIN sqlite_master m ON d.name = m.name GROUP BY 1"
            ):
                pages[table] = int(size)
        except sqlite3.OperationalError:  # a build without the dbstat table
            pass
        tables = {}
        for table in TABLES:
            try:
                rows = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
            except sqlite3.OperationalError:
                continue
            tables[table] = (int(rows), pages.get(table, -1))
        return in_use * page_size, tables
    finally:
        conn.close()


def run(args: argparse.Namespace, folder: Path, logprobs: int | None) -> None:
    path = folder / f"log-{logprobs or 0}.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    empty_bytes, _ = stored_bytes(path)
    requests = workload(args.num_requests, args.system_words, args.seed)
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        for _, max_tokens in requests
    ]
    started = time.perf_counter()
    config = {"dtype": args.dtype} if args.dtype else {}
    with LLM(max_num_seqs=args.max_num_seqs, event_log_url=url, **config) as llm:
        outputs = llm.generate([prompt for prompt, _ in requests], params)
    elapsed_s = time.perf_counter() - started
    num_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    shared_prompt = len(outputs[0].prompt_token_ids)
    total, tables = stored_bytes(path)
    label = "defaults" if logprobs is None else f"logprobs={logprobs}"
    print(
        f"\n{label}: {len(outputs)} requests, {num_tokens} generated tokens, shared prompt {shared_prompt} tokens, "
        f"{elapsed_s:.1f} s"
    )
    print(f"  log bytes per generated token: {(total - empty_bytes) / num_tokens:.1f}")
    print(f"  {'table':<18} {'rows':>8} {'rows/token':>11} {'bytes/token':>12}")
    for table, (rows, size) in tables.items():
        shown = f"{size / num_tokens:.1f}" if size >= 0 else "n/a"
        print(f"  {table:<18} {rows:>8} {rows / num_tokens:>11.3f} {shown:>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--system-words", type=int, default=1220, help="words of the shared system prompt (1,220: about 1,370 tokens)"
    )
    parser.add_argument("--dtype", default=None, help="the model dtype (default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("defaults", "logprobs"), help="run one configuration")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        if args.only != "logprobs":
            run(args, Path(folder), None)
        if args.only != "defaults":
            run(args, Path(folder), 20)


if __name__ == "__main__":
    main()
