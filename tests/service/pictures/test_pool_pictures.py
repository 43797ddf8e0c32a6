"""The pictures of the pool (``nanoserve log plot``, ``log state --svg``) of a real preempting workload.

The log is written by the engine itself: the tiny random model on the small
pool of the preemption tests (24 blocks of 4 tokens, 12 requests of up to 54
tokens), where requests are preempted and recomputed. What the SVGs say is
compared with ``replay`` after every event.
"""

from __future__ import annotations

import random
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from nanoserve.allocator.log import read_events, replay
from nanoserve.engine import LLM, SamplingParams, TokensPrompt
from nanoserve.service.cli.main import main
from nanoserve.service.pictures.owner_colours import FREE_COLOUR

SVG = "{http://www.w3.org/2000/svg}"
BAR_TITLE = re.compile(r"(\S+) held block (\d+) from seq (\d+)(?: to (\d+))?.*?(?:freed: (\S+))?$")


@pytest.fixture(scope="module")
def log_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('pictures') / 'log.db'}"
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=24,
        block_size=4,
        event_log_url=url,
        enable_prefix_caching=False,  # the pictures of the plain pool (test_prefix_cache_log draws shared ones)
    )
    rng = random.Random(3)
    prompts = [TokensPrompt([rng.randrange(3, 49152) for _ in range(rng.randint(8, 30))]) for _ in range(12)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    llm.shutdown()
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    return url


def titled(path: Path) -> dict[str, tuple[ET.Element, str]]:
    found = {}
    for element in ET.parse(path).getroot().iter():
        title = element.find(f"{SVG}title")
        if title is not None:
            found[element.get("id", "")] = (element, title.text or "")
    return found


def replayed_intervals(url: str) -> set[tuple[str, int, int, int | None]]:
    """(owner, block, first seq held, seq that freed it or None) from replay after every event."""
    last_seq = read_events(url)[-1].seq
    since: dict[int, tuple[str, int]] = {}  # block -> (owner, seq it was taken)
    spans = set()
    for seq in range(1, last_seq + 1):
        owners = replay(url, until_seq=seq).owners
        for block, (owner, start) in list(since.items()):
            if owners.get(block) != owner:
                spans.add((owner, block, start, seq))
                del since[block]
        for block, owner in owners.items():
            since.setdefault(block, (owner, seq))
    spans.update((owner, block, start, None) for block, (owner, start) in since.items())
    return spans


def test_block_map_bars_are_the_held_intervals_replay_gives(log_url: str, tmp_path: Path) -> None:
    out = tmp_path / "plot.svg"
    assert main(["log", "plot", "--url", log_url, "-o", str(out)]) == 0
    bars = [BAR_TITLE.match(text).groups() for key, (_, text) in titled(out).items() if key.startswith("interval-")]  # type: ignore[union-attr]
    drawn = {(owner, int(block), int(start), None if end is None else int(end)) for owner, block, start, end, _ in bars}
    assert len(drawn) == len(bars)  # one titled element per interval
    assert drawn == replayed_intervals(log_url)
    preempted = {(o, int(b), int(s)) for o, b, s, _, reason in bars if reason == "preempted"}
    frees = [e for e in read_events(log_url) if e.reason == "preempted"]
    assert len(preempted) == sum(len(e.block_ids) for e in frees) > 0


def test_state_grid_at_a_preemption_is_the_replayed_pool(log_url: str, tmp_path: Path) -> None:
    seq = next(e.seq for e in read_events(log_url) if e.reason == "preempted")
    out = tmp_path / "state.svg"
    assert main(["log", "state", "--url", log_url, "--at", str(seq), "--svg", str(out)]) == 0
    state = replay(log_url, until_seq=seq)
    shapes = titled(out)
    owners, colours = {}, {}
    for key, (element, text) in shapes.items():
        if key.startswith("block-"):
            block = int(key.split("-")[1])
            colours[block] = re.search(r"fill: (#[0-9a-f]{6})", element.find(f"{SVG}path").get("style")).group(1)  # type: ignore[union-attr]
            if match := re.search(r"held by (\S+)", text):
                owners[block] = match.group(1)
    assert len(colours) == 24
    assert owners == state.owners != {}
    assert {b for b, c in colours.items() if c == FREE_COLOUR} == set(state.free_block_ids)
    by_owner = {owner: {colours[b] for b, o in owners.items() if o == owner} for owner in set(owners.values())}
    assert all(len(c) == 1 for c in by_owner.values())  # one colour per request ...
    assert len({c for cs in by_owner.values() for c in cs}) == len(by_owner)  # ... and no two share one
    stack = [int(shapes[f"free-{p}"][1].rsplit(" ", 1)[1]) for p in range(state.num_free)]
    assert stack == list(reversed(state.free_block_ids))


def test_png_of_the_workload_is_written(log_url: str, tmp_path: Path) -> None:
    out = tmp_path / "plot.png"
    assert main(["log", "plot", "--url", log_url, "--x", "step", "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
