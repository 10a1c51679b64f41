"""The flat-shapes world of the trained demo models: the words, the drawing, and the
pixel statistics that tell what a picture shows.

One home for both sides: :mod:`app.devtools.train_shapes` draws its data set with
:func:`draw`, and the content tests read results with :func:`inspect` (dominant hue, filled or
outlined, circle/square/triangle by how much of its bounding box the shape fills).

A picture is ``PIXELS`` x ``PIXELS`` RGB (32 x 32): one shape of one colour on a plain
background, e.g. ``"a red circle on a black background"``. Style ``filled`` paints the shape
solid; ``outlined`` draws only its edge, ``STROKE`` pixels wide.

Imports only numpy and PIL (no torch).
"""

from __future__ import annotations

import colorsys
import io
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BACKGROUNDS",
    "COLOURS",
    "PIXELS",
    "SHAPES",
    "STROKE",
    "STYLES",
    "Reading",
    "caption",
    "draw",
    "inspect",
    "inspect_png",
    "parse",
]

PIXELS = 32
STROKE = 3  # an outline's width, pixels (at 32 x 32)

#: colour word -> RGB (hues spread round the wheel so that a reading can tell them apart)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 140, 20),
    "yellow": (235, 215, 30),
    "green": (40, 170, 60),
    "blue": (40, 80, 230),
    "purple": (150, 50, 200),
}
#: background word -> RGB (grey levels: no hue, so the shape's hue is the only one)
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"black": (0, 0, 0), "white": (255, 255, 255), "gray": (128, 128, 128)}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
STYLES: tuple[str, ...] = ("filled", "outlined")

#: hue of each colour word, degrees
HUES: dict[str, float] = {name: colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0] * 360 for name, rgb in COLOURS.items()}


def caption(colour: str, shape: str, background: str | None) -> str:
    """``"a red circle on a black background"``; without a background: ``"a red circle"``."""
    words = f"a {colour} {shape}"
    return f"{words} on a {background} background" if background else words


def parse(prompt: str) -> dict[str, str | None]:
    """The colour, shape and background words a prompt names (None for each it does not)."""
    words = prompt.lower().replace(",", " ").split()
    found: dict[str, str | None] = {"colour": None, "shape": None, "background": None}
    for index, word in enumerate(words):
        if word in COLOURS and found["colour"] is None:
            found["colour"] = word
        elif word in SHAPES:
            found["shape"] = word
        elif word in BACKGROUNDS and index + 1 < len(words) and words[index + 1] == "background":
            found["background"] = word
    return found


def draw(
    colour: str, shape: str, background: str, style: str, *, size: int = 20, centre: tuple[int, int] = (16, 16)
) -> Any:
    """A ``PIXELS`` x ``PIXELS`` RGB ``PIL.Image``: ``shape`` (``size`` pixels across, centred at
    ``centre``, pixels) in ``colour`` on ``background``; ``style`` filled or outlined."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (PIXELS, PIXELS), BACKGROUNDS[background])
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    half = size // 2
    x, y = centre
    box = (x - half, y - half, x + half - 1, y + half - 1)
    solid = style == "filled"
    if shape == "circle":
        pen.ellipse(box, fill=fill if solid else None, outline=fill, width=STROKE)
    elif shape == "square":
        pen.rectangle(box, fill=fill if solid else None, outline=fill, width=STROKE)
    else:
        points = [(x, y - half), (x + half - 1, y + half - 1), (x - half, y + half - 1)]
        if solid:
            pen.polygon(points, fill=fill)
        else:
            pen.line([*points, points[0], points[1]], fill=fill, width=STROKE, joint="curve")
    return image


@dataclass(frozen=True)
class Reading:
    """What a picture shows, by pixel statistics.

    colour: the colour word nearest the dominant hue of the coloured pixels (None: none).
    hue: that dominant hue, degrees. coloured: the fraction of pixels with a hue (saturated
    and not dark). background: the grey word nearest the uncoloured pixels' mean.
    box_fill: coloured pixels / their bounding box's area (filled circle ~0.79, square ~1,
    triangle ~0.5; an outline ~0.3-0.45). centre_fill: the fraction of coloured pixels in the
    middle of that box (a filled shape ~1, an outline ~0). holes: the uncoloured pixels the
    coloured ones enclose (not reachable from the picture's edge, 4-connected), as a fraction
    of the shape's area with them (a filled shape 0, a closed outline ~0.3-0.6). style:
    outlined when centre_fill is below 0.5 or holes at least 0.05, else filled. top_corners, bottom_corners: the
    coloured fraction of the box's corners (a
    sixth of its sides). shape: square (all four corners coloured), triangle (the lower two
    only) or circle (neither), for either style.
    """

    colour: str | None
    hue: float
    coloured: float
    background: str
    box_fill: float
    centre_fill: float
    style: str
    shape: str
    top_corners: float = 0.0
    bottom_corners: float = 0.0
    holes: float = 0.0


def _hue_distance(a: Any, b: float) -> Any:
    d = abs(a - b) % 360
    return d if not hasattr(d, "shape") else __import__("numpy").minimum(d, 360 - d)


def _holes(mask: Any) -> float:
    """The fraction of the filled-in shape that is enclosed background (see :class:`Reading`)."""
    import numpy as np

    free = ~mask
    outside = np.zeros_like(mask)
    for edge in (np.s_[0, :], np.s_[-1, :], np.s_[:, 0], np.s_[:, -1]):
        outside[edge] = free[edge]
    while True:  # grow the outside through uncoloured pixels, 4-connected
        grown = outside.copy()
        grown[1:] |= outside[:-1]
        grown[:-1] |= outside[1:]
        grown[:, 1:] |= outside[:, :-1]
        grown[:, :-1] |= outside[:, 1:]
        grown &= free
        if (grown == outside).all():
            break
        outside = grown
    enclosed = int((free & ~outside).sum())
    return enclosed / max(enclosed + int(mask.sum()), 1)


def inspect(image: Any) -> Reading:
    """Read an RGB ``PIL.Image`` (any size): see :class:`Reading`."""
    import numpy as np

    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    high, low = rgb.max(axis=2), rgb.min(axis=2)
    saturation = (high - low) / np.maximum(high, 1e-6)
    mask = (saturation > 0.45) & (high > 0.3)
    hsv = np.asarray(image.convert("RGB").convert("HSV"), dtype=np.float32)
    hues = hsv[..., 0] * 360.0 / 255.0
    coloured = float(mask.mean())
    grey = rgb[~mask].mean() if (~mask).any() else 0.5
    background = min(BACKGROUNDS, key=lambda name: abs(BACKGROUNDS[name][0] / 255 - grey))
    if coloured < 0.01:
        return Reading(None, 0.0, coloured, background, 0.0, 0.0, "none", "none")
    # the dominant hue: the colour word with the most coloured pixels nearest it
    nearest = np.argmin(np.stack([_hue_distance(hues[mask], HUES[name]) for name in COLOURS]), axis=0)
    counts = np.bincount(nearest, minlength=len(COLOURS))
    colour = list(COLOURS)[int(counts.argmax())]
    hue = float(np.median(hues[mask][nearest == counts.argmax()]))
    # the shape: the largest blob of that colour's pixels, read inside its bounding box
    ys, xs = np.nonzero(mask)
    y0, y1 = np.percentile(ys, [1, 99]).astype(int)
    x0, x1 = np.percentile(xs, [1, 99]).astype(int)
    box = mask[y0 : y1 + 1, x0 : x1 + 1]
    box_fill = float(box.mean())
    h, w = box.shape
    centre = box[h * 3 // 8 : max(h * 5 // 8, h * 3 // 8 + 1), w * 3 // 8 : max(w * 5 // 8, w * 3 // 8 + 1)]
    centre_fill = float(centre.mean())
    holes = _holes(mask)
    style = "outlined" if centre_fill < 0.5 or holes >= 0.05 else "filled"
    ch, cw = max(1, h // 6), max(1, w // 6)  # the box's corners: a square fills all four, a triangle the lower two
    top = float((box[:ch, :cw].mean() + box[:ch, -cw:].mean()) / 2)
    bottom = float((box[-ch:, :cw].mean() + box[-ch:, -cw:].mean()) / 2)
    shape = "square" if top > 0.5 and bottom > 0.5 else "triangle" if bottom > 0.4 and top < 0.3 else "circle"
    return Reading(colour, hue, coloured, background, box_fill, centre_fill, style, shape, top, bottom, holes)


def inspect_png(data: bytes) -> Reading:
    """:func:`inspect` of PNG bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return inspect(image)
