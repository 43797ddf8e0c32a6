"""``PlotFrame``: the x extent of a picture of the pool, and what its margins hold.

::

    margin │ the events in view (x_lo .. x_hi)                              │ margin
    ░░░░░░░│▇▇▇▇▇▇▇▇ a bar taken before the window runs into the left margin │
    ░░░░░░░│        ▇▇▇▇▇▇▇▇▇▇▇▇▇▇ a bar still held at POOL_CLOSE ▇▇▇▇▇▇▇▇▇│◀ held at the end
    hatched: events not drawn (before --from, after --to, or past the damage)

A margin is wide (``WIDE_MARGIN`` of the range) when it holds something: the
hatched events not drawn, or the marks of blocks still held after the last
event (both: twice as wide, the marks first); otherwise narrow. Bars cut by the window are drawn into the hatched
margin, so a bar that ends at the range's edge is one that ended there.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.service.pictures.timeline_view import TimelineView

NARROW_MARGIN = 0.01  # of the x range
WIDE_MARGIN = 0.035


@dataclass(frozen=True)
class PlotFrame:
    """x range of the view (``x_lo``..``x_hi``, the first and last event in view) and the axes' limits around it.

    ``hidden_before`` / ``hidden_after``: the left / right margin stands for
    events not drawn (before the window, after it, or past a damaged log's
    first bad record); ``held_marks``: the right margin carries the marks of
    blocks still held after the last event. ``left < x_lo <= x_hi < right``.
    """

    x_lo: float
    x_hi: float
    left: float
    right: float
    hidden_before: bool
    hidden_after: bool
    held_marks: bool

    @classmethod
    def of(cls, view: TimelineView, x: str, damaged: bool) -> PlotFrame:
        """The frame of ``view`` on the axis ``x``; ``damaged``: the timeline stops before a damaged record."""
        x_lo, x_hi = view.x_range
        at_end = view.last == view.timeline.num_events - 1
        hidden_before = view.first > 0
        hidden_after = not at_end or damaged
        held_marks = at_end and bool(view.open.any())
        smallest = 1e-3 if x == "time" else 0.5  # the narrowest margin, in x units
        span = x_hi - x_lo
        left = max(span * (WIDE_MARGIN if hidden_before else NARROW_MARGIN), smallest)
        right_share = WIDE_MARGIN * (int(hidden_after) + int(held_marks)) or NARROW_MARGIN  # both: side by side
        right = max(span * right_share, smallest)
        return cls(x_lo, x_hi, x_lo - left, x_hi + right, hidden_before, hidden_after, held_marks)

    @property
    def held_mark_x(self) -> float:
        """Where the marks of blocks held after the last event stand: in the right margin, clear of the edge line."""
        return self.x_hi + (self.right - self.x_hi) * (0.25 if self.hidden_after else 0.5)

    @property
    def hidden_after_name_x(self) -> float:
        """Where the name of the events not drawn after the view stands: the right margin, past the held marks."""
        return self.x_hi + (self.right - self.x_hi) * (0.75 if self.held_marks else 0.5)
