"""Stop strings: finding them across token boundaries and holding back their prefixes."""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Finds stop strings in a growing text and says how much of it is safe to release.

    Text that could still become the start of a stop string is held back:
    releasing it early would stream text the caller must then not see.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = list(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, new_from: int, released: int) -> tuple[int, str] | None:
        """The earliest stop string ending in ``text[new_from:]``.

        new_from: length of the text before the latest delta.
        released: characters already released (a match never starts before).
        Returns (start index, stop string) or None.
        """
        if not self.stop:
            return None
        start = max(released, new_from - self.max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def safe_end(self, text: str, released: int) -> int:
        """Index up to which ``text`` may be released.

        The earliest position p >= released (within max_stop_len - 1 of the end)
        whose suffix ``text[p:]`` is a proper prefix of some stop string;
        ``len(text)`` when there is none.
        """
        if not self.stop:
            return len(text)
        for p in range(max(released, len(text) - self.max_stop_len + 1), len(text)):
            tail = text[p:]
            if any(stop.startswith(tail) and stop != tail for stop in self.stop):
                return p
        return len(text)
