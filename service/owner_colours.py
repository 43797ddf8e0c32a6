"""``OwnerColours``: one colour per request in a picture of the pool, a neutral one past a readable number.

More than about eighteen colours cannot be told apart, so a picture with more
owners colours the ones that held the most blocks for longest and draws the
rest in one neutral grey ("other requests"). Colours go to the chosen owners in
the order they first took a block, so the first request is blue in every
picture whose owners all fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# matplotlib's tab20 without its greys (grey means "other requests"), dark shades first
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
)
OTHER_COLOUR = "#8c8c8c"  # the owners past the palette
FREE_COLOUR = "#ffffff"


class OwnerColours:
    """owner -> colour for one picture.

    ``weights``: owner -> how much of the picture it fills (block-events held),
    in order of first allocation; ``num_owners`` the owners in the picture
    (default: those in ``weights``, which may hold only the heaviest). With at
    most ``len(PALETTE)`` owners each has its own colour; with more, the
    ``len(PALETTE) - 1`` heaviest keep one and the rest share ``OTHER_COLOUR``.
    """

    def __init__(self, weights: Mapping[str, float], num_owners: int | None = None) -> None:
        num_owners = len(weights) if num_owners is None else num_owners
        owners = list(weights)
        if num_owners > len(PALETTE):
            heaviest = set(sorted(owners, key=lambda owner: -weights[owner])[: len(PALETTE) - 1])
            owners = [owner for owner in owners if owner in heaviest]
        self.colours: dict[str, str] = dict(zip(owners, PALETTE))  # owner -> its own colour
        self.num_others = num_owners - len(self.colours)  # owners drawn in OTHER_COLOUR

    def __getitem__(self, owner: str) -> str:
        return self.colours.get(owner, OTHER_COLOUR)

    def legend(self) -> list[tuple[str, str]]:
        """(label, colour) per coloured owner, then the others' entry when there are any."""
        entries = list(self.colours.items())
        if self.num_others:
            entries.append((f"{self.num_others:,} other requests", OTHER_COLOUR))
        return entries

    @classmethod
    def of(cls, owners: Iterable[str]) -> OwnerColours:
        """Equal weights: the first ``len(PALETTE) - 1`` owners keep a colour when there are too many."""
        return cls(dict.fromkeys(owners, 1.0))
