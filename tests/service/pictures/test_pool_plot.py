"""``nanoserve log plot`` and ``log state --svg``: the pictures of the pool, read back from their SVG.

Each bar of the block map, each cell of the grid and each marker is an SVG
element with an id and a ``<title>``; the tests parse the file with
``xml.etree`` and compare what it says with the log (``read_timeline``, ``replay``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, BlockEvent, EventKind, FreeReason, Violation
from nanoserve.allocator.log import Event, EventLog, audit, replay
from nanoserve.migrations import upgrade
from nanoserve.service.cli.main import main
from nanoserve.service.grpc import allocation_convert
from nanoserve.service.pictures.occupancy_panel import deepest_brief_dip
from nanoserve.service.pictures.owner_colours import FREE_COLOUR
from nanoserve.service.pictures.pool_timeline import PoolTimeline, read_timeline
from nanoserve.service.pictures.timeline_view import TimelineView, cell_extremes, event_xs

SVG = "{http://www.w3.org/2000/svg}"
# "A held block 0 from seq 2 to 4 (steps 0 to 1), freed: preempted" / "... from seq 3 (step 0), still held at ..."
BAR_TITLE = re.compile(r"(\S+) held block (\d+) from seq (\d+)(?: to (\d+))?")


def titled(path: Path) -> dict[str, tuple[ET.Element, str]]:
    """id -> (element, its <title> text) of every element with a tooltip."""
    found = {}
    for element in ET.parse(path).getroot().iter():
        title = element.find(f"{SVG}title")
        if title is not None:
            found[element.get("id", "")] = (element, title.text or "")
    return found


def bars(path: Path) -> set[tuple[str, int, int, int | None]]:
    """(owner, block, start seq, end seq or None) of every bar of the block map."""
    spans = set()
    for element_id, (_, text) in titled(path).items():
        if element_id.startswith("interval-"):
            owner, block, start, end = BAR_TITLE.match(text).groups()  # type: ignore[union-attr]
            spans.add((owner, int(block), int(start), None if end is None else int(end)))
    return spans


def path_xs(element: ET.Element) -> list[float]:
    """The x coordinates of the first <path> in ``element`` (``M x y L x y ...``)."""
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", element.find(f"{SVG}path").get("d"))]  # type: ignore[union-attr]
    return numbers[0::2]


def fill(element: ET.Element) -> str:
    style = element.find(f"{SVG}path").get("style")  # type: ignore[union-attr]
    return re.search(r"fill: (#[0-9a-f]{6})", style).group(1)  # type: ignore[union-attr]


def write_trace(url: str, close: bool = True) -> EventLog:
    """Seq 1 POOL_INIT; A [0, 1] seq 2, B [2] seq 3, A preempted seq 4, C [1] seq 5, C aborted seq 6,
    A [1, 0] seq 7 (step 3); closed at seq 8 with A and B still holding blocks (leaks), or left open."""
    log = EventLog.open(url, pool_id="p", num_blocks=6, block_size=4)
    pool = BlockAllocator(6, 4)
    pool.allocate_for(8, "A")
    pool.allocate("B")
    log.append_batch(0, pool.take_events(), pool.snapshot)
    pool.free_all([0, 1], FreeReason.PREEMPTED)
    pool.allocate("C")
    log.append_batch(1, pool.take_events(), pool.snapshot)
    pool.free(1, FreeReason.ABORTED)
    log.append_batch(2, pool.take_events(), pool.snapshot)
    pool.allocate_for(8, "A")
    log.append_batch(3, pool.take_events(), pool.snapshot)
    if close:
        log.close()
    else:
        log.flush()
        log._writer.stop()  # a crash: no POOL_CLOSE
    return log


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A migrated SQLite log."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    return url


def test_block_map_has_one_titled_bar_per_held_interval(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_trace(url)
    out = tmp_path / "plot.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 1  # the leaks are violations
    assert bars(out) == {
        ("A", 0, 2, 4),
        ("A", 1, 2, 4),
        ("B", 2, 3, None),
        ("C", 1, 5, 6),
        ("A", 1, 7, None),
        ("A", 0, 7, None),
    }
    assert bars(out) == {(i.owner, i.block_id, i.start_seq, i.end_seq) for i in read_timeline(url).intervals()}
    captured = capsys.readouterr()
    assert captured.out == f"wrote {out}: 8 events: 6 held intervals, one bar each; occupancy event by event\n"
    assert "the audit found 3 violation(s), first bad seq 8" in captured.err


def test_a_large_pool_is_drawn_up_to_its_highest_held_block(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's first plot of the default pool (2,912 blocks) showed its few bars as a line at the bottom."""
    from nanoserve.service.pictures import pool_plot

    with EventLog.open(url, pool_id="p", num_blocks=1000, block_size=4) as log:
        pool = BlockAllocator(1000, 4)
        held = pool.allocate_for(400, "A")  # seq 2: blocks 0..99
        log.append_batch(0, pool.take_events(), pool.snapshot)
        pool.free_all(held, FreeReason.FINISHED)  # seq 3
        log.append_batch(1, pool.take_events(), pool.snapshot)
    picture = pool_plot.plot_timeline(read_timeline(url))
    assert picture.figure.axes[0].get_ylim() == (-0.5, 99.5)
    assert picture.figure.axes[1].get_ylim() == (0.0, 100.0)  # the occupancy on the same scale
    assert picture.figure.axes[1].get_ylabel() == "blocks\n(of 1,000)"
    assert "100 held intervals, one bar each (blocks 100–999 not drawn: free throughout)" in picture.summary
    violation = Violation(seq=3, rule="double_free", message="x", block_id=700)  # a mark is never cut off
    assert pool_plot.plot_timeline(read_timeline(url), violations=[violation]).figure.axes[0].get_ylim() == (
        -0.5,
        700.5,
    )
    out = tmp_path / "plot.png"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 0
    assert "(blocks 100–999 not drawn: free throughout)" in capsys.readouterr().out


def test_bar_titles_name_steps_and_how_the_holding_ended(url: str, tmp_path: Path) -> None:
    write_trace(url)
    out = tmp_path / "plot.svg"
    main(["log", "plot", "--url", url, "-o", str(out)])
    texts = sorted(text for element_id, (_, text) in titled(out).items() if element_id.startswith("interval-"))
    assert texts == [
        "A held block 0 from seq 2 to 4 (steps 0 to 1), freed: preempted",
        "A held block 0 from seq 7 (step 3), still held at POOL_CLOSE: leaked",
        "A held block 1 from seq 2 to 4 (steps 0 to 1), freed: preempted",
        "A held block 1 from seq 7 (step 3), still held at POOL_CLOSE: leaked",
        "B held block 2 from seq 3 (step 0), still held at POOL_CLOSE: leaked",
        "C held block 1 from seq 5 to 6 (steps 1 to 2), freed: aborted",
    ]


def test_leaks_are_marked_at_pool_close(url: str, tmp_path: Path) -> None:
    write_trace(url)
    out = tmp_path / "plot.svg"
    main(["log", "plot", "--url", url, "-o", str(out)])
    shapes = titled(out)
    leaks = {key: text for key, (_, text) in shapes.items() if key.startswith("leak-")}
    assert leaks == {
        "leak-0": "block 0 still held by A at POOL_CLOSE (seq 8): leaked",
        "leak-1": "block 1 still held by A at POOL_CLOSE (seq 8): leaked",
        "leak-2": "block 2 still held by B at POOL_CLOSE (seq 8): leaked",
    }
    assert {(v.block_id, v.owner) for v in audit(url).violations} == {(0, "A"), (1, "A"), (2, "B")}
    assert not any(key.startswith("violation-") for key in shapes)  # the leaks are not marked twice
    assert shapes["close-marker-0"][1] == "POOL_CLOSE, seq 8: 3 blocks of 2 requests still held: leaked"


def test_broken_allocator_rules_are_marked_where_they_happened(url: str, tmp_path: Path) -> None:
    log = EventLog.open(url, pool_id="p", num_blocks=4, block_size=4)
    log.append_batch(None, [BlockEvent(EventKind.ALLOCATE_FOR, (0, 1), "A", None)])  # seq 2
    log.append_batch(None, [BlockEvent(EventKind.FREE, (1,), "B", FreeReason.FINISHED)])  # seq 3: B frees A's block
    log.append_batch(None, [BlockEvent(EventKind.FREE, (1,), "A", FreeReason.FINISHED)])  # seq 4: a double free
    log.append_batch(None, [BlockEvent(EventKind.FREE, (0,), "A", FreeReason.FINISHED)])  # seq 5
    log.close()
    out = tmp_path / "rules.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 1
    marks = sorted(text for key, (_, text) in titled(out).items() if key.startswith("violation-"))
    assert marks == [
        "seq 3 block 1 owner 'B': owner_mismatch: block is held by 'A'",
        "seq 4 block 1 owner 'A': free_of_free_block: block is not allocated",
    ]
    assert bars(out) == {("A", 0, 2, 5), ("A", 1, 2, 3)}


def test_open_epoch_draws_the_crash_marker_at_the_last_durable_seq(url: str, tmp_path: Path) -> None:
    write_trace(url, close=False)
    out = tmp_path / "crash.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 0
    shapes = titled(out)
    crash, text = shapes["crash-marker-0"]
    assert text == (
        "last durable event, seq 7: the epoch is open (running, or crashed). "
        "Bars reaching this line were held then (3 blocks of 2 requests)"
    )
    [crash_x] = set(path_xs(crash))
    held_at_crash = [e for i, (e, t) in shapes.items() if i.startswith("interval-") and "still held" in t]
    assert len(held_at_crash) == 3  # A's two blocks and B's, drawn up to the crash
    assert all(max(path_xs(bar)) == pytest.approx(crash_x) for bar in held_at_crash)
    freed = next(e for i, (e, t) in shapes.items() if i.startswith("interval-") and "to 4" in t)
    assert max(path_xs(freed)) < crash_x
    assert "close-marker-0" not in shapes


def test_an_open_epoch_a_later_one_followed_is_drawn_as_crashed(url: str, tmp_path: Path) -> None:
    """``log epochs`` and ``log audit`` named epoch 1 crashed once epoch 2 opened; the plot said 'open
    (running, or crashed)' in its heading and at its last durable event."""
    crashed = write_trace(url, close=False)
    crashed._pool_lock.release()  # its server died, and with it its lock
    EventLog.open(url, pool_id="p", num_blocks=6, block_size=4).close()
    out = tmp_path / "crashed.svg"
    assert main(["log", "plot", "--url", url, "--epoch", "1", "-o", str(out)]) == 0
    _, text = titled(out)["crash-marker-0"]
    assert text.startswith("last durable event, seq 7: the epoch is crashed; epoch 2 opened the pool after it. ")
    texts = [t.text or "" for t in ET.parse(out).getroot().iter(f"{SVG}text")]
    heading = next(line for line in texts if line.startswith("pool 'p' · epoch 1"))
    assert heading.endswith(
        " · crashed; epoch 2 opened the pool after it: last durable seq 7, 3 blocks of 2 requests held then"
    )


@pytest.mark.parametrize("command", ["plot", "state"])
def test_a_picture_path_that_cannot_be_written_is_one_line_and_exit_2_before_drawing(
    url: str, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's `log plot -o /nonexistent/dir/x.svg` drew the whole picture, then ended in a traceback."""
    write_trace(url)
    (tmp_path / "folder.svg").mkdir()
    flag = ["-o"] if command == "plot" else ["--at", "5", "--svg"]
    for path, why in [
        (tmp_path / "missing" / "x.svg", f"no folder {str(tmp_path / 'missing')!r}"),
        (tmp_path / "folder.svg", "it is a folder"),
    ]:
        assert main(["log", command, "--url", url, *flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert err == f"nanoserve log {command}: cannot write the picture to {str(path)!r}: {why}\n"


def test_range_keeps_the_bars_held_in_it(url: str, tmp_path: Path) -> None:
    write_trace(url)
    out = tmp_path / "range.svg"
    main(["log", "plot", "--url", url, "--from", "5", "--to", "6", "-o", str(out)])
    assert bars(out) == {("B", 2, 3, None), ("C", 1, 5, 6)}  # A's first blocks went at 4, its next come at 7


def test_png_is_written(url: str, tmp_path: Path) -> None:
    write_trace(url)
    out = tmp_path / "plot.png"
    assert main(["log", "plot", "--url", url, "--x", "step", "-o", str(out)]) == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("axis", ["step", "time"])
def test_other_time_axes_draw_the_same_bars(url: str, tmp_path: Path, axis: str) -> None:
    write_trace(url)
    out = tmp_path / f"{axis}.svg"
    assert main(["log", "plot", "--url", url, "--x", axis, "-o", str(out)]) == 1
    assert len(bars(out)) == 6


def test_step_axis_spreads_a_steps_events_across_it(url: str) -> None:
    write_trace(url)
    timeline = read_timeline(url)
    assert timeline.steps == [None, 0, 0, 1, 1, 2, 3, None]
    # POOL_INIT takes the first step, POOL_CLOSE the last one
    assert event_xs(timeline, "step").tolist() == [0.0, 1 / 3, 2 / 3, 1.0, 1.5, 2.0, 3.0, 3.5]
    assert event_xs(timeline, "seq").tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    times = event_xs(timeline, "time")
    assert times[0] == 0.0
    assert times.tolist() == sorted(times.tolist())


def test_steps_are_refused_when_the_events_carry_none(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with EventLog.open(url, pool_id="p", num_blocks=2, block_size=4) as log:
        pool = BlockAllocator(2, 4)
        pool.allocate("A")
        log.append_batch(None, pool.take_events(), pool.snapshot)
    assert main(["log", "plot", "--url", url, "--x", "step", "-o", str(tmp_path / "x.svg")]) == 2
    assert "the events carry no scheduler step: use --x seq or --x time" in capsys.readouterr().err


def test_cells_show_the_holder_at_each_cells_middle(url: str) -> None:
    """The image of a large block map, checked cell by cell against replay."""
    write_trace(url)
    timeline = read_timeline(url)
    view = TimelineView(timeline, event_xs(timeline, "seq"), 0, timeline.num_events - 1)
    holders = view.cell_holders(14)  # seqs 1..8: cells of 0.5 seq
    for k, middle in enumerate(view.cell_middles(14)):
        owners = replay(url, until_seq=int(middle)).owners  # held over [start, end): at x = 2.25, after seq 2
        seen = {b: timeline.owners[view.owner[holders[b, k]]] for b in range(6) if holders[b, k] >= 0}
        assert seen == owners, f"cell {k} at x {middle}"


def test_cell_extremes_give_each_runs_lowest_and_highest() -> None:
    starts, low, high = cell_extremes(np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]), 3)
    assert (starts.tolist(), low.tolist(), high.tolist()) == ([0, 3, 6], [1, 1, 2], [4, 9, 6])


def test_a_million_event_epoch_is_drawn_as_cells(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_BARS bars (here 3) the block map is an image and the figure says what it aggregated."""
    from nanoserve.service.pictures import occupancy_panel, pool_plot

    monkeypatch.setattr(pool_plot, "MAX_BARS", 3)
    monkeypatch.setattr(occupancy_panel, "MAX_OCCUPANCY_POINTS", 4)
    monkeypatch.setattr(pool_plot, "NUM_CELLS", 4)
    write_trace(url)
    picture = pool_plot.plot_timeline(read_timeline(url))
    assert picture.summary == (
        "8 events: 6 held intervals drawn as 6 blocks × 4 cells (a cell: who held the block at its middle; "
        "one cell spans about 2 events); occupancy as lowest..highest per cell of 4 (about 2 events each)"
    )
    assert not any(key.startswith("interval-") for key in picture.titles)
    # block map, preemption and abort counts per cell, occupancy, running requests
    _, counts_ax, _, _ = picture.figure.axes
    labels = [label.get_text() for label in counts_ax.get_yticklabels()]
    assert labels == ["preemptions: 1", "aborts: 1"]
    scale_ends = sorted(t.get_text() for t in counts_ax.texts)  # a colour scale beside each row: 0 .. most
    assert scale_ends == ["0", "0", "1 per cell", "1 per cell"]
    assert len(counts_ax.child_axes) == 2
    by_step = pool_plot.plot_timeline(read_timeline(url), x="step")
    # steps 0..3, the last one drawn a step wide: 4 steps over 4 cells
    assert "one cell spans 1 step, about 2 events" in by_step.summary


def test_empty_epoch_exits_2_without_a_picture(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    EventLog.open(url, pool_id="p", num_blocks=4, block_size=4).close()
    out = tmp_path / "empty.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 2
    assert capsys.readouterr().err == "nanoserve log plot: nothing to plot: epoch 1 of pool 'p' holds no allocations\n"
    assert not out.exists()


def test_a_cut_epoch_whose_allocations_are_all_archived_is_drawn_from_its_checkpoint(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every request of the epoch ended before the cut at its SNAPSHOT 45 (seqs 1..44 in a segment file):
    the live part holds no allocation, yet the epoch held 20. Was: exit 2, "epoch 1 ... holds no allocations"."""
    from nanoserve.allocator.log.archive import RetentionPolicy
    from nanoserve.allocator.log.segment_archive import LiveSize, archive_due_segment

    log = EventLog.open(url, pool_id="default", num_blocks=8, block_size=4, num_events_per_snapshot=10)
    pool = BlockAllocator(8, 4)
    for n in range(20):  # seqs 2..45: a request allocates and ends in each batch, SNAPSHOTs at 12, 23, 34, 45
        pool.free_all(pool.allocate_for(4, f"r{n}"), FreeReason.FINISHED)
        log.append_batch(None, pool.take_events(), pool.snapshot)
    log.flush()
    policy = RetentionPolicy(retention_bytes=1_000)
    [entry] = archive_due_segment(url, tmp_path / "arch", policy, upgrade, "default", LiveSize())
    assert (entry.first_seq, entry.last_seq) == (1, 44)
    log.close(final_state=pool.snapshot())  # 46 POOL_CLOSE
    out = tmp_path / "cut.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"wrote {out}: 2 events: 0 held intervals, one bar each; occupancy event by event\n"
    assert captured.err == (
        "nanoserve log plot: the live log holds no allocation of epoch 1 from its checkpoint at seq 45: seqs 1..44 "
        "are archived in segment files (`nanoserve log state --at SEQ` names the one holding a seq; plot it with "
        "--url sqlite:///FILE)\n"
    )
    assert bars(out) == set()
    assert "seqs 1–44 archived: drawn from the checkpoint at 45" in out.read_text()


def test_log_without_epochs_exits_2(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", url]) == 0
    capsys.readouterr()
    assert main(["log", "plot", "--url", url, "-o", str(tmp_path / "x.svg")]) == 2
    assert capsys.readouterr().err == "nanoserve log plot: the log holds no pools\n"


def _edit_record(url: str, seq: int, old: str, new: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        record = conn.execute(sa.text("SELECT record FROM allocator_events WHERE seq = :s"), {"s": seq}).scalar_one()
        conn.execute(
            sa.text("UPDATE allocator_events SET record = :r WHERE seq = :s"), {"r": record.replace(old, new), "s": seq}
        )
    engine.dispose()


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_damaged_log_is_drawn_up_to_its_first_bad_seq(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_trace(url)
    _edit_record(url, 5, "|C", "|Q")  # a forged owner: the hash chain breaks at seq 5
    out = tmp_path / "damaged.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "nanoserve log plot: the log is damaged from seq 5: seq 5 owner 'C': hash_mismatch: stored hash" in err
    assert bars(out) == {("A", 0, 2, 4), ("A", 1, 2, 4), ("B", 2, 3, None)}
    assert titled(out)["damage-marker-0"][1] == (
        "log damaged: first bad record at seq 5; it and all after it are not drawn. "
        "Bars reaching this line were held at seq 4 (1 block of 1 request)"
    )


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_log_damaged_at_its_start_exits_1_without_a_picture(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_trace(url)
    _edit_record(url, 2, "|A", "|Q")
    out = tmp_path / "damaged.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "nanoserve log plot: nothing before the damage to draw"
    assert not out.exists()


def test_unknown_file_type_exits_2(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_trace(url)
    assert main(["log", "plot", "--url", url, "-o", str(tmp_path / "x.jpg")]) == 2
    assert "the picture's file must end in .svg or .png" in capsys.readouterr().err


def test_bad_range_exits_2(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_trace(url)
    assert main(["log", "plot", "--url", url, "--from", "9", "--to", "20", "-o", str(tmp_path / "x.svg")]) == 2
    assert "no events in seqs 9..20: the epoch holds seqs 1..8" in capsys.readouterr().err


def test_missing_matplotlib_names_the_extra(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import nanoserve.service.pictures

    write_trace(url)
    for name in list(sys.modules):
        pictures = ("nanoserve.service.pictures.pool_plot", "nanoserve.service.pictures.pool_grid")
        if name.startswith(("matplotlib", *pictures)):
            monkeypatch.delitem(sys.modules, name)
    for module in ("pool_plot", "pool_grid"):
        monkeypatch.delattr(nanoserve.service.pictures, module, raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    assert main(["log", "plot", "--url", url, "-o", str(tmp_path / "x.svg")]) == 2
    assert capsys.readouterr().err == (
        "nanoserve log plot: matplotlib is not installed: pip install 'nanoserve[plot]'\n"
    )
    assert main(["log", "state", "--url", url, "--at", "3", "--svg", str(tmp_path / "x.svg")]) == 2
    assert capsys.readouterr().err.endswith("matplotlib is not installed: pip install 'nanoserve[plot]'\n")


def test_the_command_line_starts_without_matplotlib() -> None:
    code = (
        "import sys; from nanoserve.service.cli.main import build_parser; build_parser(); "
        "print('matplotlib' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_state_svg_colours_exactly_the_allocated_blocks(url: str, tmp_path: Path) -> None:
    with EventLog.open(url, pool_id="p", num_blocks=10, block_size=4) as log:
        pool = BlockAllocator(10, 4)
        pool.allocate_for(12, "A")  # seq 2: 0, 1, 2
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.allocate_for(8, "B")  # seq 3: 3, 4
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.free(1)  # seq 4
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.allocate("C")  # seq 5: 1
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.free_all([3, 4], FreeReason.PREEMPTED)  # seq 6
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.allocate("A")  # seq 7: 4
        log.append_batch(None, pool.take_events(), pool.snapshot)
    out = tmp_path / "state.svg"
    assert main(["log", "state", "--url", url, "--at", "7", "--svg", str(out)]) == 0
    state = replay(url, until_seq=7)
    shapes = titled(out)
    cells = {int(i.split("-")[1]): (fill(e), t) for i, (e, t) in shapes.items() if i.startswith("block-")}
    assert sorted(cells) == list(range(10))
    owner_in_title = {b: re.search(r"held by (\S+)", t) for b, (_, t) in cells.items()}
    assert {b: m.group(1) for b, m in owner_in_title.items() if m} == state.owners == {0: "A", 2: "A", 1: "C", 4: "A"}
    assert {b for b, (colour, _) in cells.items() if colour == FREE_COLOUR} == set(state.free_block_ids)
    colours = {owner: {cells[b][0] for b, o in state.owners.items() if o == owner} for owner in ("A", "C")}
    assert all(len(c) == 1 for c in colours.values())
    assert colours["A"] != colours["C"]
    assert cells[4][1] == "block 4: held by A since seq 7, logical block 2 of its table"
    assert cells[3][1] == "block 3: free, #1 out of the free stack"
    stack = [shapes[f"free-{p}"][1] for p in range(sum(1 for i in shapes if i.startswith("free-")))]
    assert [int(t.rsplit(" ", 1)[1]) for t in stack] == list(reversed(state.free_block_ids)) == [3, 5, 6, 7, 8, 9]
    assert shapes["table-0"][1] == "A's block table, logical block 0 first"
    heading = next(t.text for t in ET.parse(out).getroot().iter(f"{SVG}text") if "the pool after" in (t.text or ""))
    assert heading == "pool 'p' · epoch 1 · the pool after seq 7: A given block 4 (outlined)"
    outlined = [
        b
        for b, (e, _) in ((int(i[6:]), v) for i, v in shapes.items() if i.startswith("block-"))
        if "stroke: #000000" in e.find(f"{SVG}path").get("style")
    ]  # type: ignore[union-attr]
    assert outlined == [4]


def test_state_svg_lists_block_tables_in_logical_order(url: str, tmp_path: Path) -> None:
    with EventLog.open(url, pool_id="p", num_blocks=10, block_size=4) as log:
        pool = BlockAllocator(10, 4)
        pool.allocate_for(12, "A")  # 0, 1, 2
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.allocate("B")  # 3
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.free(0)
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.allocate("A")  # 0 again, now A's fourth block
        log.append_batch(None, pool.take_events(), pool.snapshot)
    out = tmp_path / "state.svg"
    assert main(["log", "state", "--url", url, "--at", "5", "--svg", str(out)]) == 0
    texts = [t.text for t in ET.parse(out).getroot().iter(f"{SVG}text")]
    assert "A (3 blocks): 1 → 2 → 0" in texts
    assert "B (1 block): 3" in texts


def test_audit_report_message_carries_the_plot_range(url: str) -> None:
    write_trace(url)
    message = allocation_convert.to_audit_response(audit(url))
    assert [(v.seq, v.block_id, v.plot_from_seq, v.plot_to_seq) for v in message.violations] == [
        (8, 0, 7, 8),
        (8, 1, 7, 8),
        (8, 2, 3, 8),
    ]


def test_audit_command_names_the_range_to_plot(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    write_trace(url)
    assert main(["log", "audit", "--url", url]) == 1
    assert "    seq 8 block 2 owner 'B': leaked_block: block still allocated at POOL_CLOSE (plot --from 3 --to 8)" in (
        capsys.readouterr().out.splitlines()
    )


def svg_texts(path: Path) -> list[str]:
    """The text of every <text> element (svg.fonttype none: the picture's words are text)."""
    return [t.text or "" for t in ET.parse(path).getroot().iter(f"{SVG}text")]


def svg_words(path: Path) -> str:
    """All the picture's text, one space between words: a legend entry wrapped over lines reads whole."""
    return " ".join(" ".join(svg_texts(path)).split())


def use_x(element: ET.Element) -> float:
    """The x of a marker (a scatter's <use>) inside ``element``."""
    return float(next(element.iter(f"{SVG}use")).get("x"))  # type: ignore[arg-type]


def test_marks_of_preemptions_and_aborts_name_the_request(url: str, tmp_path: Path) -> None:
    write_trace(url)
    out = tmp_path / "plot.svg"
    main(["log", "plot", "--url", url, "-o", str(out)])
    shapes = titled(out)
    marks = {key: text for key, (_, text) in shapes.items() if key.startswith(("preempted-", "aborted-"))}
    assert marks == {
        "preempted-0": "A preempted at seq 4 (step 1): blocks 0, 1 freed for recompute",
        "aborted-0": "C aborted at seq 6 (step 2): block 1 freed",
    }
    texts = svg_texts(out)
    # the legend says what happened to each request, and the request's name is written on its bar by its marks
    assert {"A · preempted at seq 4 · leaked: 2 blocks", "B · leaked: 1 block", "C · aborted at seq 6"} <= set(texts)
    assert texts.count("A") == 2  # by its preemption and by its leak
    assert texts.count("C") == 1  # by its abort


def test_leak_marks_stand_past_the_close_line(url: str, tmp_path: Path) -> None:
    """A block held at POOL_CLOSE is marked beyond the line, where no bar freed before it can reach."""
    write_trace(url)
    out = tmp_path / "plot.svg"
    main(["log", "plot", "--url", url, "-o", str(out)])
    shapes = titled(out)
    [close_x] = set(path_xs(shapes["close-marker-0"][0]))
    assert all(use_x(shapes[f"leak-{block}"][0]) > close_x + 5 for block in (0, 1, 2))


def test_clean_close_says_no_block_was_held(url: str, tmp_path: Path) -> None:
    with EventLog.open(url, pool_id="p", num_blocks=4, block_size=4) as log:
        pool = BlockAllocator(4, 4)
        pool.allocate_for(8, "A")  # seq 2
        log.append_batch(0, pool.take_events(), pool.snapshot)
        pool.free_all([0, 1], FreeReason.FINISHED)  # seq 3
        log.append_batch(1, pool.take_events(), pool.snapshot)
    out = tmp_path / "clean.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 0
    assert titled(out)["close-marker-0"][1] == "POOL_CLOSE, seq 4: no block held then (clean)"
    assert "pool 'p' · epoch 1 · 4 blocks of 4 tokens · closed at seq 4, no block held then" in svg_texts(out)


def test_aggregated_picture_names_the_leaks(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn as cells, the picture marks and names the blocks held at POOL_CLOSE as the bars do."""
    from nanoserve.service.pictures import pool_plot

    monkeypatch.setattr(pool_plot, "MAX_BARS", 3)
    monkeypatch.setattr(pool_plot, "NUM_CELLS", 4)
    write_trace(url)
    out = tmp_path / "cells.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 1
    shapes = titled(out)
    assert not any(key.startswith("interval-") for key in shapes)  # cells, not bars
    assert {key: text for key, (_, text) in shapes.items() if key.startswith("leak-")} == {
        "leak-0": "block 0 still held by A at POOL_CLOSE (seq 8): leaked",
        "leak-1": "block 1 still held by A at POOL_CLOSE (seq 8): leaked",
        "leak-2": "block 2 still held by B at POOL_CLOSE (seq 8): leaked",
    }
    assert shapes["close-marker-0"][1].startswith("POOL_CLOSE, seq 8: 3 blocks of 2 requests still held: leaked")
    assert "leaked: 3 blocks still held at POOL_CLOSE (seq 8) by A, B" in svg_words(out)  # the legend


def test_aggregated_close_says_what_the_last_cell_cannot_show(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks freed after the last cell's middle look held to the end: the close line's legend says they were not."""
    from nanoserve.service.pictures import pool_plot

    monkeypatch.setattr(pool_plot, "MAX_BARS", 1)
    monkeypatch.setattr(pool_plot, "NUM_CELLS", 2)
    with EventLog.open(url, pool_id="p", num_blocks=4, block_size=4) as log:
        pool = BlockAllocator(4, 4)
        for owner in "ABCD":  # seqs 2, 3, 4, 5
            pool.allocate(owner)
            log.append_batch(None, pool.take_events(), pool.snapshot)
        for block in (0, 1, 2, 3):  # seqs 6, 7, 8, 9; POOL_CLOSE seq 10
            pool.free(block, FreeReason.FINISHED)
            log.append_batch(None, pool.take_events(), pool.snapshot)
    picture = pool_plot.plot_timeline(read_timeline(url))
    close = picture.titles["close-marker-0"]
    # x from seq 1 to 11 (the close drawn one seq wide): cells of 5 seqs, the last one's middle at x 8.5,
    # after seq 8, when D still held block 3
    assert close == (
        "POOL_CLOSE, seq 10: no block held then (clean). "
        "The map's last cell shows the pool at seq 8; 1 blocks held then were freed after it"
    )


def test_cells_take_the_colour_of_how_the_holding_ended_past_the_palette(url: str) -> None:
    from nanoserve.service.pictures import pool_plot
    from nanoserve.service.pictures.owner_colours import PALETTE

    with EventLog.open(url, pool_id="p", num_blocks=2, block_size=4) as log:
        pool = BlockAllocator(2, 4)
        for k in range(len(PALETTE) + 2):  # more requests than colours
            block_ids = pool.allocate_for(4, f"r{k}")
            pool.free_all(block_ids, FreeReason.PREEMPTED if k % 2 else FreeReason.FINISHED)
            log.append_batch(k, pool.take_events(), pool.snapshot)
    timeline = read_timeline(url)
    original = pool_plot.MAX_BARS
    try:
        pool_plot.MAX_BARS = 1
        picture = pool_plot.plot_timeline(timeline)
    finally:
        pool_plot.MAX_BARS = original
    legend = picture.figure.axes[0].get_legend()
    assert legend.get_title().get_text() == "20 requests: a cell's colour says\nhow the holding it shows ended"
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels[:2] == ["then freed: finished", "then freed: preempted"]


def test_bars_cut_by_the_window_say_so_and_run_into_its_margin(url: str, tmp_path: Path) -> None:
    write_trace(url)
    out = tmp_path / "window.svg"
    main(["log", "plot", "--url", url, "--from", "5", "--to", "6", "--x", "step", "-o", str(out)])
    shapes = titled(out)
    bars = {text.split(" from")[0]: (element, text) for key, (element, text) in shapes.items() if "interval-" in key}
    b_bar, b_text = bars["B held block 2"]
    c_bar, c_text = bars["C held block 1"]
    assert b_text == (
        "B held block 2 from seq 3 (step 0), taken before this window (seqs 5–6) and held past it, "
        "still held at POOL_CLOSE: leaked"
    )
    assert c_text == "C held block 1 from seq 5 to 6 (steps 1 to 2), freed: aborted"  # inside the window: not cut
    # C was taken at the window's first event; B began before it and is drawn from further left, into the margin
    assert min(path_xs(b_bar)) < min(path_xs(c_bar)) - 5
    texts = svg_texts(out)
    assert "drawn: seqs 5–6 of 1–8 (the window chosen with --from/--to) = steps 1–2 · x axis: scheduler step" in texts
    assert {"seqs before 5: not drawn", "seqs after 6: not drawn"} <= set(texts)


def test_bar_freed_after_the_window_says_so(url: str, tmp_path: Path) -> None:
    write_trace(url)
    out = tmp_path / "window.svg"
    main(["log", "plot", "--url", url, "--from", "2", "--to", "3", "-o", str(out)])
    texts = sorted(text for key, (_, text) in titled(out).items() if key.startswith("interval-"))
    assert texts == [
        "A held block 0 from seq 2 to 4 (steps 0 to 1), held past this window (seqs 2–3), freed: preempted",
        "A held block 1 from seq 2 to 4 (steps 0 to 1), held past this window (seqs 2–3), freed: preempted",
        "B held block 2 from seq 3 (step 0), held past this window (seqs 2–3), still held at POOL_CLOSE: leaked",
    ]


def _event(
    seq: int, kind: EventKind, seconds: float, block_ids: tuple[int, ...] = (), owner: str | None = None
) -> Event:
    data = {"num_blocks": 4, "block_size": 4} if kind == EventKind.POOL_INIT else None
    reason = "finished" if kind == EventKind.FREE_ALL else None
    return Event("p", 1, seq, seq, kind.value, block_ids, owner, None, reason, int(seconds * 1e9), 0, data, b"")


def test_time_axis_spreads_the_events_of_one_step_over_the_gap_before_it() -> None:
    """Events sharing one time (one step's batch) get the time since the previous one, at most the median gap."""
    timeline = PoolTimeline()
    timeline.apply(
        [
            _event(1, EventKind.POOL_INIT, 0.0),
            _event(2, EventKind.ALLOCATE_FOR, 1.0, (0, 1), "A"),  # a step ending at 1.0 s
            _event(3, EventKind.ALLOCATE, 1.0, (2,), "B"),
            _event(4, EventKind.FREE_ALL, 1.5, (0, 1), "A"),  # a step ending at 1.5 s: the pool drains ...
            _event(5, EventKind.FREE_ALL, 1.5, (2,), "B"),
            _event(6, EventKind.ALLOCATE, 1.5, (0,), "C"),  # ... and refills
            _event(7, EventKind.FREE_ALL, 3.5, (0,), "C"),  # after an idle pause of 2 s
            _event(8, EventKind.POOL_CLOSE, 3.5),
        ]
    )
    # gaps 1.0, 0.5, 2.0: median 1.0, so the last step takes 1.0 s, not the 2.0 s idle
    assert event_xs(timeline, "time").tolist() == pytest.approx(
        [0.0, 0.5, 1.0, 1.5 - 1 / 3, 1.5 - 1 / 6, 1.5, 3.0, 3.5]
    )
    assert timeline.num_allocated.tolist() == [0, 2, 3, 1, 0, 1, 0, 0]  # empty for 1/6 s: an area, not a line


def test_a_dip_briefer_than_a_pixel_is_named() -> None:
    xs = np.array([0.0, 1.0, 1.0001, 2.0, 3.0])
    assert deepest_brief_dip(xs, np.array([3.0, 0.0, 4.0, 4.0, 4.0])) == 1  # 0 blocks from x 1.0 to 1.0001
    assert deepest_brief_dip(xs, np.array([3.0, 5.0, 4.0, 4.0, 4.0])) is None  # no dip below both neighbours
    assert deepest_brief_dip(np.array([0.0, 1.0, 2.0, 3.0]), np.array([3.0, 1.0, 3.0, 3.0])) is None  # wide


def test_running_requests_have_their_own_panel(url: str) -> None:
    """Not a twin axis over the occupancy: the line cannot be read as the allocated area's edge."""
    from nanoserve.service.pictures import pool_plot

    write_trace(url)
    picture = pool_plot.plot_timeline(read_timeline(url))
    _, occupancy_ax, running_ax = picture.figure.axes
    assert occupancy_ax.get_ylabel() == "blocks"
    assert running_ax.get_ylabel() == "running\nrequests"
    picture.figure.canvas.draw()
    assert running_ax.get_position().y1 < occupancy_ax.get_position().y0
    # the last value is drawn up to x_stop: one more point, repeating it
    assert running_ax.lines[0].get_ydata().tolist() == [0, 1, 2, 1, 2, 1, 2, 2, 2]


def test_state_lists_the_preempted_requests_waiting(url: str, tmp_path: Path) -> None:
    with EventLog.open(url, pool_id="p", num_blocks=6, block_size=4) as log:
        pool = BlockAllocator(6, 4)
        pool.allocate_for(8, "A")  # seq 2: 0, 1
        pool.allocate("B")  # seq 3: 2
        pool.allocate("C")  # seq 4: 3
        log.append_batch(0, pool.take_events(), pool.snapshot)
        pool.free_all([0, 1], FreeReason.PREEMPTED)  # seq 5
        pool.free_all([2], FreeReason.FINISHED)  # seq 6
        pool.free_all([3], FreeReason.PREEMPTED)  # seq 7
        pool.allocate("D")  # seq 8
        log.append_batch(1, pool.take_events(), pool.snapshot)
    out = tmp_path / "state.svg"
    assert main(["log", "state", "--url", url, "--at", "8", "--svg", str(out)]) == 0
    words = svg_words(out)
    assert "holding no block now (the log knows a request once it held one):" in words
    assert "preempted, waiting to be recomputed (2): C (since seq 7), A (since seq 5)" in words
    assert "finished (1): B" in words
    assert "1 allocated, 5 free of 6 blocks of 4 tokens; 1 request holds blocks, 2 preempted wait to be recomputed" in (
        words
    )


def test_state_counts_a_parallel_requests_samples_as_its_samples(url: str, tmp_path: Path) -> None:
    """A new user read '4 requests hold blocks' for one request of n=3: its samples are named ID#k."""
    with EventLog.open(url, pool_id="p", num_blocks=8, block_size=4) as log:
        pool = BlockAllocator(8, 4)
        prompt = pool.allocate_for(2, "R")  # seq 2: block 0, half full
        for index in range(3):
            pool.fork("R", f"R#{index}", prompt, partial=True)  # seqs 3-5
        for index in range(3):
            pool.copy_on_write(f"R#{index}", "R", prompt[0])  # seqs 6-8: blocks 1-3, a copy of block 0 each
        pool.allocate("x#1")  # seq 9: a request whose own id ends in #1, with no owner "x" beside it
        log.append_batch(0, pool.take_events(), pool.snapshot)
    out = tmp_path / "state.svg"
    assert main(["log", "state", "--url", url, "--at", "9", "--svg", str(out)]) == 0
    assert "5 allocated, 3 free of 8 blocks of 4 tokens; 2 requests hold blocks, with 3 parallel samples" in (
        svg_words(out)
    )


def test_what_the_last_event_did_is_drawn_with_a_width(url: str) -> None:
    """A fresh reviewer found the last event of an open epoch invisible: its bar had no width and its
    occupancy step sat under the crash line. The state after the last event is drawn one event wide."""
    from nanoserve.service.pictures import pool_plot

    log = EventLog.open(url, pool_id="p", num_blocks=4, block_size=4)
    pool = BlockAllocator(4, 4)
    pool.allocate("A")  # seq 2
    log.append_batch(None, pool.take_events(), pool.snapshot)
    pool.allocate_for(8, "B")  # seq 3: the last durable event, then the process "dies"
    log.append_batch(None, pool.take_events(), pool.snapshot)
    log.flush()
    timeline = read_timeline(url)
    view = TimelineView(timeline, event_xs(timeline, "seq"), 0, timeline.num_events - 1)
    assert view.x_range == (1.0, 4.0)
    b_bars = [k for k in range(view.num_bars) if timeline.owners[view.owner[k]] == "B"]
    assert [(view.x0[k], view.x1[k]) for k in b_bars] == [(3.0, 4.0), (3.0, 4.0)]
    picture = pool_plot.plot_timeline(timeline)
    _, occupancy_ax, running_ax = picture.figure.axes
    assert occupancy_ax.lines[0].get_xydata().tolist()[-2:] == [[3.0, 3.0], [4.0, 3.0]]  # 3 blocks held up to x 4
    assert running_ax.lines[0].get_ydata().tolist()[-1] == 2
    log.close()


def test_a_preemption_that_frees_and_releases_is_one_mark(url: str, tmp_path: Path) -> None:
    """With prefix caching a preempted request's uncached blocks are one FREE and its registered ones one
    RELEASE, in the same step: the picture says it was preempted once, with all its blocks."""
    from nanoserve.allocator.block_key import hash_block

    log = EventLog.open(url, pool_id="p", num_blocks=6, block_size=4)
    pool = BlockAllocator(6, 4)
    blocks = pool.allocate_for(12, "A")  # [0, 1, 2]
    key = hash_block(None, [1, 2, 3, 4], ())
    pool.register("A", None, blocks[:1], [key])
    log.append_batch(0, pool.take_events(), pool.snapshot)
    pool.release("A", blocks, FreeReason.PREEMPTED)
    ended = pool.take_events()
    assert [event.kind for event in ended] == [EventKind.FREE_ALL, EventKind.RELEASE]  # two events, one preemption
    log.append_batch(1, ended, pool.snapshot)
    log.close()

    out = tmp_path / "plot.svg"
    main(["log", "plot", "--url", url, "-o", str(out)])
    marks = {key: text for key, (_, text) in titled(out).items() if key.startswith("preempted-")}
    assert marks == {"preempted-0": "A preempted at seq 4 (step 1): blocks 0, 1, 2 freed for recompute"}
    assert any(
        "preempted (its blocks freed for recompute): 1 time, 1 request, 3 block marks" in text
        for text in svg_texts(out)
    )


def test_a_cut_epoch_is_drawn_from_its_checkpoint_and_says_what_is_archived(url: str, tmp_path: Path) -> None:
    """Issue 30: seqs 1..44 went into a segment file; the blocks held at the checkpoint (45) are bars from 45."""
    from nanoserve.allocator.log.archive import RetentionPolicy
    from nanoserve.allocator.log.segment_archive import LiveSize, archive_due_segment
    from tests.allocator.test_segment_archive import Busy

    busy = Busy(url, "default")
    busy.run(20)
    archive_due_segment(url, tmp_path / "arch", RetentionPolicy(retention_bytes=1_000), upgrade, "default", LiveSize())
    busy.run(1)
    busy.close()
    out = tmp_path / "cut.svg"
    assert main(["log", "plot", "--url", url, "-o", str(out)]) == 0
    assert bars(out) == {("keep", 0, 45, 49), ("keep", 1, 45, 49), ("r19", 2, 45, 46), ("r20", 2, 47, 48)}
    text = out.read_text()
    assert "seqs 1–44 archived: drawn from the checkpoint at 45" in text
    assert "drawn: seqs 45–50 (all the live log holds)" in text
