"""StoredEvents: the pages of the log's stored events that catch-ups read, decoded once for all of them.

WatchEvents and SubscribeKvEvents catch up from the store a page at a time
(``follow_events``). ``LogReads.run_shared`` lets the callers that ask for a page
before its read takes a thread share that read, but a crowd does not arrive at
once: 100 catch-ups from seq 1 (bench/read_paths.py) still read and decoded the
same page dozens of times, and each read's new ``Event`` objects were converted to
messages again (``EventMessages`` shares the bytes of one ``Event`` object). py-spy
during that load: the reader threads held the GIL 45% of the time, decoding, and a
running stream made 13-27% of its idle rate while the load lasted.

A committed event never changes, and an epoch's stored events are a run of seqs
without gaps, so a page once read stays true: what a later caller lacks is its
tail, the events committed since. Here a page is kept as read (the same ``Event``
objects for every caller) and grown by reads of its tail alone; a tail is read
only when the log says events past the page's end are durable (``durable_seq``: the
store holds no later one), so a page caught up with the log costs no query at all.
A caller still gets every event stored before it asked, as a read of its own would.

An archived segment of the open epoch moves the epoch's first rows out of the store
(a catch-up from seq 1 then starts at the checkpoint after them): ``forget`` drops
every kept page, and the server's archiver calls it after each such cut.
"""

from __future__ import annotations

import asyncio
import collections

from nanoserve.allocator.log import Event, EventLog, read_events
from nanoserve.engine.core.log_reads import LogReads

NUM_EVENTS_PER_PAGE = 1000  # stored events read per query while catching up
MAX_EVENTS = 16_384  # decoded events kept, all pages together (16 full pages, about 10 MB)

# (url, pool_id, epoch, first seq): a page
PageKey = tuple[str, str, int, int]


class StoredEvents:
    """Invariant: a kept page of ``(url, pool_id, epoch, first_seq)`` holds the committed events of
    that epoch from ``first_seq`` on in seq order, without gap, at most ``num_events_per_page``; it
    only grows (a longer read of the same page replaces it). At most ``max_events`` events are kept
    in all, the least recently asked page dropped first (event loop only).

    reads: the reader threads that run the store's queries (``LogReads.run_shared``: callers asking
    for the same tail before its read starts share it); None: a thread of asyncio's own per read.
    """

    def __init__(
        self,
        reads: LogReads | None = None,
        num_events_per_page: int = NUM_EVENTS_PER_PAGE,
        max_events: int = MAX_EVENTS,
    ) -> None:
        if num_events_per_page < 1:
            raise ValueError(f"num_events_per_page must be >= 1, got {num_events_per_page}")
        if max_events < num_events_per_page:
            raise ValueError(f"max_events must be >= num_events_per_page ({num_events_per_page}), got {max_events}")
        self.reads = reads
        self.num_events_per_page = num_events_per_page
        self.max_events = max_events
        self.num_events = 0  # events in the kept pages
        self._generation = 0  # forget() calls so far
        # page -> its events, least recently asked first
        self._pages: collections.OrderedDict[PageKey, tuple[Event, ...]] = collections.OrderedDict()

    async def page(self, event_log: EventLog, first_seq: int, scope: str = "") -> tuple[Event, ...]:
        """The current epoch's committed events with ``first_seq <= seq < first_seq + num_events_per_page``,
        in seq order: every one stored before the call, perhaps later ones (fewer than a page: the
        store holds no more yet). The same ``Event`` objects for every caller (do not change them).
        Raises the reader's errors (``LogUnavailableError``, ``LogDamagedError``); a failed read
        keeps nothing."""
        key = (event_log.url, event_log.pool_id, event_log.epoch, first_seq)
        generation = self._generation
        kept = self._pages.get(key, ())
        if kept:
            self._pages.move_to_end(key)
        next_seq = kept[-1].seq + 1 if kept else first_seq
        last_seq = first_seq + self.num_events_per_page - 1
        if next_seq > last_seq or next_seq > event_log.durable_seq:  # full, or nothing newer is durable
            return kept
        query = (event_log.url, event_log.pool_id, event_log.epoch, next_seq, last_seq)
        tail = await (
            self.reads.run_shared(query, read_events, *query, scope=scope)
            if self.reads is not None
            else asyncio.to_thread(read_events, *query)
        )
        return self._grown(key, kept, tail, generation)

    def forget(self) -> None:
        """Drops every kept page (an archived segment cut the open epoch's first rows out of the store)."""
        self._pages.clear()
        self.num_events = 0
        self._generation += 1  # a read in flight keeps nothing: it may have begun before the cut

    def _grown(self, key: PageKey, kept: tuple[Event, ...], tail: list[Event], generation: int) -> tuple[Event, ...]:
        """``kept`` and its ``tail``, kept unless a read that ended meanwhile kept a longer page or
        ``forget`` was called since ``generation``."""
        page = kept + tuple(tail)
        if generation != self._generation:
            return page
        current = self._pages.get(key, ())
        if len(current) >= len(page):
            return current  # holds ``page``: both run from the page's first seq without gap
        self.num_events -= len(current)
        self._pages[key] = page
        self._pages.move_to_end(key)
        self.num_events += len(page)
        while self.num_events > self.max_events:
            _, dropped = self._pages.popitem(last=False)
            self.num_events -= len(dropped)
        return page
