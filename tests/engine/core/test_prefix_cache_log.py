"""The log tools on a prefix-cached epoch: show prints keys and counts, state who shares what, the
plot's timeline follows replay's holders, cached-free and shared blocks event by event."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.allocator.log import read_events, replay
from nanoserve.engine import LLM, SamplingParams, TokensPrompt
from nanoserve.service.cli.main import main
from nanoserve.service.pictures.pool_timeline import PoolTimeline

SYSTEM = list(range(100, 112))  # 3 full blocks of 4


@pytest.fixture(scope="module")
def log_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('prefix-log') / 'log.db'}"
    llm = LLM(
        model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=24, block_size=4, event_log_url=url
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate(TokensPrompt([*SYSTEM, 5]), SamplingParams(temperature=0.0, max_tokens=1))
    llm.generate([TokensPrompt([*SYSTEM, 7 + i, 8, 9]) for i in range(6)], params)  # preempts: 6 x 8 blocks > 24
    llm.shutdown()
    return url


def test_timeline_follows_replay_at_every_event(log_url: str) -> None:
    events = read_events(log_url)
    timeline = PoolTimeline()
    for event in events:
        timeline.apply([event])
        state = replay(log_url, until_seq=event.seq)
        assert timeline.owners_now() == state.owners, event.seq
        assert timeline.sharers == state.sharers, event.seq
        assert timeline.cached_free == set(state.cached_free), event.seq
        assert (timeline.num_cached_free[-1], timeline.num_shared[-1]) == (len(state.cached_free), len(state.sharers))
    assert max(timeline.num_shared) == 3
    assert max(timeline.num_cached_free) > 0
    assert timeline.unknown_kinds == {}


def test_show_prints_each_share_with_its_keys_and_counts(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "show", "--url", log_url, "--kind", "share"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["keys", "(=count,", "<-parent)"]
    first_share = lines[2].split()
    assert first_share[5:7] == ["share", "0,1,2"]
    assert [entry.split("=")[1] for entry in first_share[-3:]] == ["1", "1", "1"]  # taken off the cached-free list


def test_state_names_the_requests_sharing_each_block(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    seq = next(e.seq for e in read_events(log_url) if e.kind == "share" and e.ref_counts[0] == 3)
    assert main(["log", "state", "--url", log_url, "--at", str(seq)]) == 0
    out = capsys.readouterr().out
    state = replay(log_url, until_seq=seq)
    assert "prefix cache: " in out
    for block_id, holders in state.shared_blocks().items():
        assert f"{block_id}             3      {','.join(holders)}" in out


def test_plot_draws_cached_free_and_shared_blocks(log_url: str, tmp_path: Path) -> None:
    out = tmp_path / "plot.svg"
    assert main(["log", "plot", "--url", log_url, "-o", str(out)]) == 0
    text = out.read_text()
    assert "free, still cached (prefix)" in text
    assert "shared by several requests" in text


def test_state_picture_titles_cached_free_and_shared_blocks(log_url: str, tmp_path: Path) -> None:
    events = read_events(log_url)
    at_shared = next(e.seq for e in events if e.kind == "share" and e.ref_counts[0] == 3)
    at_cached = next(e.seq for e in events if e.kind == "release" and 0 in e.ref_counts)
    for seq, expected in ((at_shared, ", shared with "), (at_cached, ": free but cached, #")):
        out = tmp_path / f"state-{seq}.svg"
        assert main(["log", "state", "--url", log_url, "--at", str(seq), "--svg", str(out)]) == 0
        assert expected in out.read_text()


def test_state_free_blocks_add_up_to_the_header_count_with_cached_ones(
    log_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a new user found the "free blocks:" ranges short of the header's "N free": cached-free blocks were left out
    seq = next(e.seq for e in read_events(log_url) if e.kind == "release" and 0 in e.ref_counts)
    state = replay(log_url, until_seq=seq)
    assert main(["log", "state", "--url", log_url, "--at", str(seq)]) == 0
    lines = capsys.readouterr().out.splitlines()
    num_cached = len(state.cached_free)
    assert num_cached > 0
    assert f"{state.num_free} free ({num_cached} of them cached), {state.num_allocated} allocated" in lines[0]
    free_line = next(line for line in lines if line.startswith("free blocks: "))
    uncached, cached = free_line.removeprefix("free blocks: ").split("; cached: ")
    listed = [_expand(uncached), _expand(cached)]
    assert listed == [sorted(state.free_block_ids), sorted(state.cached_free)]
    assert len(listed[0]) + len(listed[1]) == state.num_free


def test_state_names_every_column_of_the_shared_block_table(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    seq = next(e.seq for e in read_events(log_url) if e.kind == "share" and e.ref_counts[0] == 3)
    assert main(["log", "state", "--url", log_url, "--at", str(seq)]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("shared block"))
    assert header.split() == ["shared", "block", "count", "held", "by", "key", "copy"]


def _expand(ranges: str) -> list[int]:
    """ "0-2, 5" -> [0, 1, 2, 5]; "none" -> []."""
    if ranges == "none":
        return []
    ids: list[int] = []
    for run in ranges.split(", "):
        first, _, last = run.partition("-")
        ids.extend(range(int(first), int(last or first) + 1))
    return ids


def test_state_full_says_the_free_stack_leaves_out_the_cached_free_blocks(
    log_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seq = next(e.seq for e in read_events(log_url) if e.kind == "release" and 0 in e.ref_counts)
    state = replay(log_url, until_seq=seq)
    assert main(["log", "state", "--url", log_url, "--at", str(seq), "--full"]) == 0
    stack = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("free stack"))
    assert stack == (
        f"free stack (next out first) (and {len(state.cached_free)} cached-free, evicted after it: below): "
        + ",".join(map(str, reversed(state.free_block_ids)))
    )
