"""``OwnerColours``: one colour per request in a picture of the pool, a neutral one past a readable number.

More than about eighteen colours cannot be told apart, so a picture with more
owners colours the ones that held the most blocks for longest and draws the
rest in one neutral grey ("other requests"). An owner's colour follows from
its place in the epoch (the n-th request to take a block gets palette colour
n mod 18), so a request has the same colour in the plot of an epoch and in the
grid of any of its seqs; only when two owners of one picture would share a
colour does the later one take the next free colour.
"""

from __future__ import annotations

from collections.abc import Mapping

# 18 colours told apart at a glance (after Sasha Trubetskoy's "20 distinct colours", without its grey, white,
# black and beige: grey is "other requests", white is free, black marks aborts). The first twelve differ in hue,
# not only in lightness: neighbours in the epoch never get two shades of one colour.
PALETTE = (
    "#e6194b",  # red
    "#3cb44b",  # green
    "#ffe119",  # yellow
    "#4363d8",  # blue
    "#f58231",  # orange
    "#911eb4",  # purple
    "#42d4f4",  # cyan
    "#f032e6",  # magenta
    "#9a6324",  # brown
    "#000075",  # navy
    "#bfef45",  # lime
    "#fabed4",  # pink
    "#469990",  # teal
    "#dcbeff",  # lavender
    "#800000",  # maroon
    "#aaffc3",  # mint
    "#808000",  # olive
    "#ffd8b1",  # apricot
)
OTHER_COLOUR = "#8c8c8c"  # the owners past the palette
FREE_COLOUR = "#ffffff"


class OwnerColours:
    """owner -> colour for one picture.

    ``weights``: owner -> how much of the picture it fills (block-events held),
    in order of first allocation; ``places``: owner -> its place in the epoch
    (0 for the first to take a block: ``PoolTimeline.owner_id``); ``num_owners`` the owners in the picture
    (default: those in ``weights``, which may hold only the heaviest). With at
    most ``len(PALETTE)`` owners each has its own colour; with more, the
    ``len(PALETTE) - 1`` heaviest keep one and the rest share ``OTHER_COLOUR``.
    """

    def __init__(self, weights: Mapping[str, float], places: Mapping[str, int], num_owners: int | None = None) -> None:
        num_owners = len(weights) if num_owners is None else num_owners
        owners = list(weights)
        if num_owners > len(PALETTE):
            heaviest = set(sorted(owners, key=lambda owner: -weights[owner])[: len(PALETTE) - 1])
            owners = [owner for owner in owners if owner in heaviest]
        self.colours: dict[str, str] = {}  # owner -> its own colour
        free = list(range(len(PALETTE)))  # palette indexes not taken yet, in palette order
        for owner in owners:
            wanted = places[owner] % len(PALETTE)
            index = wanted if wanted in free else next((i for i in free if i > wanted), free[0])
            free.remove(index)
            self.colours[owner] = PALETTE[index]
        self.num_others = num_owners - len(self.colours)  # owners drawn in OTHER_COLOUR

    def __getitem__(self, owner: str) -> str:
        return self.colours.get(owner, OTHER_COLOUR)

    def legend(self) -> list[tuple[str, str]]:
        """(label, colour) per coloured owner, then the others' entry when there are any."""
        entries = list(self.colours.items())
        if self.num_others:
            entries.append((f"{self.num_others:,} other requests", OTHER_COLOUR))
        return entries
