"""Writing a matplotlib figure of the pool to a file: PNG, or SVG with a tooltip per element.

matplotlib writes an artist's ``gid`` as the ``id`` of its ``<g>`` element but
has no per-artist ``<title>`` (the SVG tooltip), so the SVG is written to
memory, given ``<title>`` children by id with the standard library's XML
tools, and then written out. SVGs carry no date and a fixed hash salt, so the
same picture gives the same bytes.
"""

from __future__ import annotations

import io
import os
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SVG_NS = "http://www.w3.org/2000/svg"
# the namespaces of matplotlib's SVG, kept under their usual prefixes when the document is written again
NAMESPACES = {
    "": SVG_NS,
    "xlink": "http://www.w3.org/1999/xlink",
    "dc": "http://purl.org/dc/elements/1.1/",
    "cc": "http://creativecommons.org/ns#",
    "rdf": "http://www.w3.org/1999/02/22-rdf-syntax-ns#",
}
FORMATS = ("svg", "png")
PNG_DPI = 110


@dataclass
class Picture:
    """A drawn picture of the pool: the figure, the tooltip of each SVG element id, and what it shows in one line."""

    figure: Any  # matplotlib.figure.Figure
    titles: dict[str, str]
    summary: str

    def save(self, path: str | Path, fmt: str | None = None) -> None:
        save_figure(self.figure, path, self.titles, fmt)


def figure_format(path: str | Path) -> str:
    """``svg`` or ``png`` from the file name, checked before the drawing's work: ValueError naming the
    suffixes, or saying why ``path`` cannot be written (a folder, a missing or read-only folder)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise ValueError(f"the picture's file must end in .svg or .png, got {str(path)!r}")
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"cannot write the picture to {str(path)!r}: it is a folder")
    if not folder.is_dir():
        raise ValueError(f"cannot write the picture to {str(path)!r}: no folder {str(folder)!r}")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"cannot write the picture to {str(path)!r}: permission denied")
    return suffix


def save_figure(figure: Any, path: str | Path, titles: Mapping[str, str], fmt: str | None = None) -> None:
    """Write ``figure`` to ``path`` as ``fmt`` (default: from the suffix).

    titles: element id (an artist's gid) -> tooltip text, added to an SVG as
    the element's ``<title>``; a PNG has no tooltips.
    """
    import matplotlib as mpl

    fmt = fmt or figure_format(path)
    buffer = io.BytesIO()
    if fmt == "png":
        figure.savefig(buffer, format="png", dpi=PNG_DPI)
        data = buffer.getvalue()
    else:
        with mpl.rc_context({"svg.hashsalt": "nanoserve", "svg.fonttype": "none"}):
            figure.savefig(buffer, format="svg", metadata={"Date": None})
        data = add_titles(buffer.getvalue(), titles)
    try:
        Path(path).write_bytes(data)
    except OSError as exc:  # the folder went away or filled up since figure_format checked it
        raise ValueError(f"cannot write the picture to {str(path)!r}: {exc.strerror or exc}") from None


def add_titles(svg: bytes, titles: Mapping[str, str]) -> bytes:
    """The SVG document with a ``<title>`` (first child) in each element whose id is in ``titles``."""
    for prefix, uri in NAMESPACES.items():
        ET.register_namespace(prefix, uri)
    root = ET.fromstring(svg)
    for element in root.iter():
        text = titles.get(element.get("id", ""))
        if text is not None:
            title = ET.Element(f"{{{SVG_NS}}}title")
            title.text = text
            element.insert(0, title)
    document: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return document
