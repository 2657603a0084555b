"""Caption faithfulness of procedural clips: does a clip show what its grammar caption says?

Every attribute of a caption of :mod:`sparsevid_lab.data.grammar` can be read back from the pixels of a
clip drawn like :class:`sparsevid_lab.data.ProceduralVideos` draws them, with no learned weights:

- **background**: the clip's background colour is the per-channel median of the pixels divided by the
  renderer's vertical shading (pixels close to an object colour left out), recomputed over the pixels
  near that first estimate (objects and texture extremes drop out). Score: the posterior of the
  captioned palette entry under a Gaussian of sigma ``BACKGROUND_SIGMA`` around each of the four palette
  colours (about 1 when the nearest palette entry is the captioned one with a clear margin, 0.5 half way
  between two entries).
- **background texture**: a textured background is its shaded colour brightened towards white or
  darkened towards black (achromatic modulation), so its pixels lie on two segments from the shaded
  colour. How far they reach (the texture strength, 0 for a plain background) is read from the clip:
  a high quantile of the lifts of the pixels on each segment, the smaller of the two sides (white and
  gray objects lie on one of them), at most ``TEXTURE_MAX``.
- **pixel labels**: every pixel goes to the nearest of the background (those two segments up to that
  strength), the eight object colours and their dark variants (``TEXTURE_DARK`` times the colour, the
  dark stripes / squares of textured objects), or to no class when it is farther than ``LABEL_RADIUS``
  from all of them (edges, blur). A dark variant too close to the background is left out (it cannot be
  told apart).
- **objects**: the pixels of an object's colour, per frame, and of its dark variant next to them.
  Objects sharing a colour are split per frame by k-means on pixel positions (seeded by the previous
  frame, so the clusters are tracks); clusters that touch in most frames and keep their offset (move
  as one) are one object. Tracks are matched to the caption's objects of
  that colour by the assignment that scores best.
- **colour**: the fraction of frames in which the object's colour covers at least ``MIN_AREA`` (in
  units of the frame's shorter side squared), saturating at ``VISIBLE_FRAMES`` of the frames (an object
  may be hidden behind a later one for a while).
- **size**: the object's radius from the second moment of its pixels, sqrt(2 E|x - centroid|^2) (equal
  to the radius for a disc, robust to stripes and checks), its median over the frames; score: a logistic
  of its distance to the border between the small and big radius ranges, signed by the captioned size.
- **motion**: from the centroid track over the frames: net displacement, path length, straightness and
  the angle swept around a least-squares circle through the track. Each of the six motions gets a
  fuzzy membership in [0, 1] (slide: a straight path of net displacement along the named axis;
  bouncing: a long path that is not a circle; circling: most of a turn around a fitted circle); the
  score is the captioned motion's membership divided by max(1, sum of all memberships).
- **count**: the number of captioned objects found (colour score >= 0.5) plus the non-captioned object
  colours covering at least ``MIN_AREA`` in at least half the frames; score 1 / (1 + |that - number
  captioned|).
- **texture**: inside the object (its bright pixels closed over gaps of 0.4 radius, the width of a dark
  stripe, then eroded by a pixel to drop anti-aliased edges), the median share of pixels that are not
  bright (plain about 0, striped and checkered about 0.5) and, among bright/dark changes inside, the
  share between horizontal neighbours (stripes are horizontal: about 0; checks about 0.5). Each gives a
  linear ramp; the score is the captioned texture's membership. Where fewer than ``TEXTURE_PIXELS``
  inside pixels show in all but one frame (small objects at low resolution), the texture is None.

``"overall"`` is the mean of the five attribute scores background, count, colour, size and motion (the
last three averaged over the clip's objects): the share of the caption the clip shows. One wrong
attribute costs its share only (a wrong background 0.2; one wrong object colour in a 3-object caption a
third of the colour score, plus what the missing object costs in size and motion); the per-attribute
scores show which. Texture is reported beside it, not in it, since it cannot always be read.

Shape is not scored: a small object at 64x64 is about 10 pixels across, where circle, square and
diamond differ by a few edge pixels, further blurred by occlusion and textures; a score would be noise.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..data import grammar
from ..data.procedural import BACKGROUND_RGB, COLOUR_RGB, RADIUS_RANGE, TEXTURE_DARK

BACKGROUND_SIGMA = 0.08  # spread of a background colour around its palette entry (RGB in [0, 1])
LABEL_RADIUS = 0.25  # farthest RGB distance at which a pixel is given a colour class
DARK_MIN_DISTANCE = 0.12  # a dark variant closer than this to the background is not a class
BACKGROUND_SAMPLES = 100_000  # pixels sampled for the background colour
OBJECT_EXCLUDE = 0.1  # pixels this close to an object colour are left out of the background colour
MIN_AREA = 0.0035  # smallest visible part of an object (frame side^2): a third of a small striped circle
VISIBLE_FRAMES = 0.75  # an object shown in this fraction of the frames has full colour score
SIZE_BORDER = math.sqrt(RADIUS_RANGE[0][1] * RADIUS_RANGE[1][0])  # between small and big radii
SIZE_WIDTH = 0.006  # logistic width of the size score (frame sides)
DARK_REACH = 0.07  # farthest a dark stripe / square lies from a bright one (0.4 of the largest radius)
TOUCH_FRAMES = 0.8  # clusters touching in this fraction of the frames and moving together
RIGID_SPREAD = 0.03  # (centroid offset varying by less than this, frame sides) are one object
WHOLE_AREA = 0.6  # motion is read from frames showing this fraction of the object's (90th percentile) area
TEXTURE_PIXELS = 12  # fewest inside pixels in a frame to read a texture from
TEXTURE_DARK_FRACTION = (0.15, 0.3)  # plain below, textured (half dark) above: a linear ramp between
TEXTURE_ACROSS = (0.2, 0.35)  # striped below, checkered above (share of changes between horizontal neighbours)
TEXTURE_FIT = 0.1  # farthest RGB distance from a brighten / darken segment read as on it (room for noise)
TEXTURE_QUANTILE = 0.98  # quantile of a side's lifts read as the texture strength
TEXTURE_MIN_LIFT = 0.02  # a pixel lifted less than this towards white / black is the plain background
TEXTURE_SHARE = 0.2  # fewest pixels (share of the clip) on a side's segment for a textured background
TEXTURE_MAX = 0.8  # strongest texture modelled: short of white's lift from the darkest background (0.95)
ATTRIBUTES = ("background", "count", "colour", "size", "motion")


def faithfulness(video: torch.Tensor, captions: list[str]) -> list[dict]:
    """Score how faithfully each clip shows its caption.

    Args:
        video: float [B, 3, T, H, W] in [-1, 1], T >= 2, any resolution.
        captions: B grammar captions (see :mod:`sparsevid_lab.data.grammar`), one per clip.

    Returns:
        One dict per clip, every score in [0, 1]: ``"overall"`` (mean of the five attribute scores
        ``"background"``, ``"count"``, ``"colour"``, ``"size"``, ``"motion"``; the last three are means
        over the clip's objects), ``"texture"`` (mean over the objects whose texture can be read; None if
        none can; not part of ``"overall"``) and ``"objects"``: one dict per captioned object, in caption
        order, with its ``"colour"``, ``"size"``, ``"motion"`` and ``"texture"`` (or None) scores and its
        ``"motion_reading"`` (None where the object was not found): ``"net"`` [dx, dy] and ``"path"``, the
        centroid's net displacement and path length in frame fractions (y down), and ``"memberships"``, its
        fuzzy membership in each of ``grammar.MOTIONS`` (what the motion score is read from).
        Runs on the CPU, on one thread (restored afterwards).
    """
    if not isinstance(video, torch.Tensor):
        raise TypeError(f"video must be a torch.Tensor, got {type(video).__name__}")
    if video.dim() != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be [B, 3, T, H, W], got shape {tuple(video.shape)}")
    if not video.is_floating_point():
        raise TypeError(f"video must be a float tensor in [-1, 1], got {video.dtype}")
    if video.shape[2] < 2:
        raise ValueError(f"video must have at least 2 frames to show motion, got T={video.shape[2]}")
    if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
        raise TypeError("captions must be a list of str")
    if len(captions) != video.shape[0]:
        raise ValueError(f"captions must hold one caption per clip: {len(captions)} captions for B={video.shape[0]}")
    parsed = []
    for caption in captions:
        try:
            parsed.append(grammar.parse_caption(caption))
        except ValueError as error:
            raise ValueError(f"captions: {error}") from None
    rgb = ((video.detach().to("cpu", torch.float32) + 1) / 2).clamp(0, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: extra threads only add overhead (and stall a busy CPU)
    try:
        return [_score_clip(rgb[b], objects, background) for b, (objects, background) in enumerate(parsed)]
    finally:
        torch.set_num_threads(threads)


def swap_attribute(caption: str, attribute: str, shift: int = 1, index: int = 0) -> str:
    """``caption`` with one attribute replaced: the value ``shift`` places further along its word list
    (cyclically; nonzero modulo the list's length). ``attribute`` is "background", or "size", "colour",
    "texture", "shape" or "motion" of object ``index`` (caption order). For validating a scorer: a
    faithful clip of ``caption`` does not show the result."""
    objects, background = grammar.parse_caption(caption)
    fields = ("size", "colour", "texture", "shape", "motion")
    words = {"background": grammar.BACKGROUNDS, **dict(zip(fields, (grammar.SIZES, grammar.COLOURS,
                                                                  grammar.TEXTURES, grammar.SHAPES, grammar.MOTIONS)))}
    if attribute not in words:
        raise ValueError(f"attribute must be one of {sorted(words)}, got {attribute!r}")
    if shift % len(words[attribute]) == 0:
        raise ValueError(f"shift must not be a multiple of {len(words[attribute])} (that keeps the {attribute})")
    if not 0 <= index < len(objects):
        raise ValueError(f"index must be in [0, {len(objects)}) for a caption of {len(objects)} objects, got {index}")
    if attribute == "background":
        return grammar.caption_text(objects, (background + shift) % len(grammar.BACKGROUNDS))
    field = fields.index(attribute)
    swapped = list(objects[index])
    swapped[field] = (swapped[field] + shift) % len(words[attribute])
    return grammar.caption_text(objects[:index] + [tuple(swapped)] + objects[index + 1:], background)


def _score_clip(clip: torch.Tensor, objects: list[tuple[int, int, int, int, int]], background: int) -> dict:
    """Scores of one clip float32 [3, T, H, W] in [0, 1] against its parsed caption."""
    height, width = clip.shape[-2:]
    shade = 1.15 - 0.3 * (torch.arange(height, dtype=torch.float32) + 0.5) / height  # the renderer's
    base = _background_colour(clip, shade)
    scores = {"background": _palette_posterior(base, BACKGROUND_RGB, background)}
    usable = _dark_usable(base)
    shaded = base.view(3, 1) * shade.view(1, -1)  # [3, H]
    labels = _label_pixels(clip, shaded, _texture_amplitude(clip, shaded), usable)
    side = float(min(height, width))
    per_object: list[dict | None] = [None] * len(objects)
    for colour in sorted({o[1] for o in objects}):
        indices = [k for k, o in enumerate(objects) if o[1] == colour]
        tracks = _colour_tracks(_object_pixels(labels, colour, side), labels == 1 + colour, len(indices), side,
                                bool(usable[colour]))
        slots = range(max(len(tracks), len(indices)))  # tracks, then "not found" (None) where there are fewer
        pair = {(k, j): _object_scores(tracks[j] if j < len(tracks) else None, objects[k])
                for k in indices for j in slots}
        best = max(itertools.permutations(slots, len(indices)),
                   key=lambda perm: sum(pair[k, j]["total"] for k, j in zip(indices, perm)))
        for k, j in zip(indices, best):
            per_object[k] = pair[k, j]
    for entry in per_object:
        del entry["total"]
    captioned = {o[1] for o in objects}
    extra = sum(1 for c in range(len(COLOUR_RGB)) if c not in captioned
                and _visible(labels == 1 + c, side).float().mean() >= 0.5)
    found = sum(1 for entry in per_object if entry["colour"] >= 0.5)
    scores["count"] = 1.0 / (1 + abs(found + extra - len(objects)))
    for name in ("colour", "size", "motion"):
        scores[name] = sum(entry[name] for entry in per_object) / len(per_object)
    readable = [entry["texture"] for entry in per_object if entry["texture"] is not None]
    scores["texture"] = sum(readable) / len(readable) if readable else None
    scores["overall"] = sum(scores[name] for name in ATTRIBUTES) / len(ATTRIBUTES)
    scores["objects"] = per_object
    return scores


def _sample_grid(clip: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A sparse grid of ``clip`` [3, T, H, W] (enough for the background statistics): every
    ``stride``-th frame, row and column, about BACKGROUND_SAMPLES pixels [3, T', H', W'], and that stride."""
    stride = max(1, round((clip[0].numel() / BACKGROUND_SAMPLES) ** (1 / 3)))
    return clip[:, ::stride, ::stride, ::stride], stride


def _background_colour(clip: torch.Tensor, shade: torch.Tensor) -> torch.Tensor:
    """Base colour float32 [3] of the background of ``clip`` [3, T, H, W] under the vertical ``shade`` [H]:
    the median of the pixels divided by the shading, leaving out those within OBJECT_EXCLUDE of an
    object colour (on a dark textured background, bright objects would pull the median into its lifted
    half), then recomputed over the pixels near that estimate."""
    pixels, stride = _sample_grid(clip)
    unshaded = (pixels / shade[::stride].view(1, 1, -1, 1)).reshape(3, -1)
    pixels = pixels.reshape(3, -1).T
    off_objects = torch.cdist(pixels, COLOUR_RGB).min(1).values >= OBJECT_EXCLUDE
    candidates = unshaded[:, off_objects] if off_objects.sum() > 0.2 * len(off_objects) else unshaded
    base = candidates.median(dim=1).values
    near = (unshaded - base.view(3, 1)).pow(2).sum(0) < LABEL_RADIUS ** 2
    if near.sum() > 0.2 * near.numel():
        base = unshaded[:, near].median(dim=1).values
    return base


def _palette_posterior(colour: torch.Tensor, palette: torch.Tensor, index: int) -> float:
    """Posterior of ``palette[index]`` given ``colour`` [3], Gaussian of sigma BACKGROUND_SIGMA per entry."""
    logits = -((palette - colour).pow(2).sum(-1)) / (2 * BACKGROUND_SIGMA ** 2)
    return float(torch.softmax(logits, 0)[index])


def _dark_usable(base: torch.Tensor) -> torch.Tensor:
    """Which dark variants of the object colours (bool [n]) differ enough from the background ``base`` [3]
    to be classes of their own."""
    return (TEXTURE_DARK * COLOUR_RGB - base).norm(dim=-1) >= DARK_MIN_DISTANCE


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot product over the leading (RGB) dimension of ``a`` and ``b`` [3, ...] (broadcast): [...]."""
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


def _along_segment(offset: torch.Tensor, direction: torch.Tensor, reach: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``offset`` float32 [3, ...] lies along ``direction`` [3, ...] (broadcast): its lift (the
    projection, in units of ``direction``) and its squared RGB distance from the segment from 0 to
    ``reach`` times ``direction``, both [...]."""
    along, length = _dot(offset, direction), _dot(direction, direction).clamp_min(1e-6)
    lift = along / length
    clamped = lift.clamp(0, reach)
    return lift, _dot(offset, offset) - 2 * clamped * along + clamped * clamped * length


def _texture_amplitude(clip: torch.Tensor, shaded: torch.Tensor) -> float:
    """Strength of the background texture of ``clip`` [3, T, H, W] around its shaded base colour
    ``shaded`` [3, H]: how far (0: plain, up to TEXTURE_MAX) the background brightens towards white and
    darkens towards black. Each side's strength is the TEXTURE_QUANTILE quantile of the lifts of the
    pixels on its segment (within TEXTURE_FIT, lifted by more than TEXTURE_MIN_LIFT), if at least
    TEXTURE_SHARE of the pixels lie there (else 0: a plain background, whose only such pixels are
    achromatic objects); the result is the smaller side (achromatic objects lie on one of the segments,
    rarely on both), the bright side alone on a background too dark to darken visibly. Capped at
    TEXTURE_MAX, short of a white object on a black background."""
    pixels, stride = _sample_grid(clip)
    row = shaded[:, ::stride].view(3, 1, -1, 1)
    offset = pixels - row
    sides = [_along_segment(offset, 1 - row, math.inf)]
    if float(_dot(shaded, shaded).min()) >= DARK_MIN_DISTANCE ** 2:
        sides.append(_along_segment(offset, -row, math.inf))
    sides = [lift[(distance < TEXTURE_FIT ** 2) & (lift > TEXTURE_MIN_LIFT)] for lift, distance in sides]
    strengths = [float(torch.quantile(side.clamp(max=1), TEXTURE_QUANTILE))
                 if len(side) >= TEXTURE_SHARE * pixels[0].numel() else 0.0 for side in sides]
    return min(min(strengths), TEXTURE_MAX)


def _label_pixels(clip: torch.Tensor, shaded: torch.Tensor, amplitude: float, usable: torch.Tensor) -> torch.Tensor:
    """Class of every pixel, int64 [T, H, W]: 0 background, 1 + c object colour c, 1 + n + c its dark
    variant (n colours; only where ``usable`` bool [n]), -1 none within LABEL_RADIUS. The background
    is its shaded colour ``shaded`` float32 [3, H] brightened towards white or darkened towards black by
    up to ``amplitude``."""
    dark = TEXTURE_DARK * COLOUR_RGB
    centres = torch.cat([COLOUR_RGB, torch.where(usable.unsqueeze(-1), dark, torch.tensor(1e3))])  # [2n, 3]
    pixels = clip.flatten(1).T  # [P, 3]
    to_colours = (pixels.pow(2).sum(1, keepdim=True) - 2 * pixels @ centres.T + centres.pow(2).sum(1))
    nearest, index = to_colours.min(1)
    row = shaded.view(3, 1, -1, 1)
    offset = clip - row
    _, to_bright = _along_segment(offset, 1 - row, amplitude)
    _, to_dark = _along_segment(offset, -row, amplitude)
    to_background = torch.minimum(to_bright, to_dark).flatten()
    labels = torch.where(to_background <= nearest, 0, 1 + index)
    labels[torch.minimum(to_background, nearest) > LABEL_RADIUS ** 2] = -1
    return labels.view(clip.shape[1:])


def _dilate(mask: torch.Tensor, reach: int) -> torch.Tensor:
    """``mask`` bool [..., H, W] grown by ``reach`` pixels (a square neighbourhood): window sums of
    cumulative sums, whose cost does not grow with ``reach``."""
    count = mask.to(torch.int32)
    for dim in (-1, -2):
        padding = (reach + 1, reach) if dim == -1 else (0, 0, reach + 1, reach)
        total = F.pad(count, padding).cumsum(dim)
        length = total.shape[dim]
        count = total.narrow(dim, 2 * reach + 1, length - 2 * reach - 1) - total.narrow(dim, 0, length - 2 * reach - 1)
    return count > 0


def _visible(mask: torch.Tensor, side: float) -> torch.Tensor:
    """Frames bool [T] in which ``mask`` [T, H, W] covers at least MIN_AREA."""
    return mask.flatten(1).sum(1) >= MIN_AREA * side * side


def _object_pixels(labels: torch.Tensor, colour: int, side: float) -> torch.Tensor:
    """Pixels bool [T, H, W] of the objects of ``colour``: its bright pixels, and its dark pixels near
    them (the dark stripes / squares of textured objects) in ``labels`` int64 [T, H, W]."""
    bright = labels == 1 + colour
    dark = labels == 1 + len(COLOUR_RGB) + colour
    return bright | (dark & _dilate(bright, math.ceil(DARK_REACH * side)))


def _colour_tracks(mask: torch.Tensor, bright: torch.Tensor, count: int, side: float,
                   dark_usable: bool) -> list[dict]:
    """Tracks of the objects drawn in one colour: ``mask`` bool [T, H, W] of its pixels (``bright`` those
    of its bright parts), ``count`` objects captioned in it; without ``dark_usable`` the masks of textured
    objects have gaps. Returns up to ``count`` tracks (see :func:`_track`)."""
    if count == 1:
        return [_track(mask, side, bright)]
    members = _split(mask, count)  # [count, T, H, W]
    groups = _merge_touching(members, side, 1 if dark_usable else math.ceil(DARK_REACH * side))
    return [_track(members[group].any(0), side, bright & members[group].any(0)) for group in groups]


def _split(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Per-frame k-means of the pixel positions of ``mask`` [T, H, W] into ``count`` clusters, each frame
    seeded by the previous one's centres: bool [count, T, H, W]."""
    frames, height, width = mask.shape
    ys, xs = torch.meshgrid(torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32),
                            indexing="ij")
    members = torch.zeros((count, frames, height, width), dtype=torch.bool)
    centres = None
    for t in range(frames):
        where = mask[t]
        points = torch.stack([xs[where], ys[where]], -1)  # [P, 2]
        if len(points) < count:
            continue
        if centres is None:  # farthest-point seeding
            seeds = [points[0]]
            for _ in range(count - 1):
                gap = torch.cdist(points, torch.stack(seeds)).min(1).values
                seeds.append(points[gap.argmax()])
            centres = torch.stack(seeds)
        for _ in range(10):
            nearest = torch.cdist(points, centres).argmin(1)
            for j in range(count):
                if (nearest == j).any():
                    centres[j] = points[nearest == j].mean(0)
        nearest = torch.cdist(points, centres).argmin(1)
        for j in range(count):
            members[j, t][where] = nearest == j
    return members


def _merge_touching(members: torch.Tensor, side: float, reach: int) -> list[list[int]]:
    """Groups of the clusters ``members`` bool [K, T, H, W] that are parts of one object: they touch
    (closer than ``reach`` pixels) in at least TOUCH_FRAMES of the frames in which both are visible, and
    move together (their centroids' offset varies by less than RIGID_SPREAD frame sides)."""
    count = members.shape[0]
    grown = _dilate(members, reach)
    tracks = [_track(m, side) for m in members]
    parent = list(range(count))
    for i, j in itertools.combinations(range(count), 2):
        both = tracks[i]["visible"] & tracks[j]["visible"]
        if int(both.sum()) < 2:
            continue
        touching = (grown[i] & members[j]).flatten(1).any(1)[both].float().mean()
        offset = tracks[i]["centre"][both] - tracks[j]["centre"][both]
        if touching >= TOUCH_FRAMES and offset.var(0).sum().sqrt() < RIGID_SPREAD:
            root_i, root_j = parent[i], parent[j]
            parent = [root_i if p == root_j else p for p in parent]
    return [[k for k in range(count) if parent[k] == root] for root in sorted(set(parent))]


def _track(mask: torch.Tensor, side: float, bright: torch.Tensor | None = None) -> dict:
    """Per-frame measurements of one object's pixels ``mask`` bool [T, H, W]: ``visible`` bool [T],
    ``centre`` float32 [T, 2] ((x, y) as fractions of the width and height), ``radius`` float32 [T]
    (second-moment radius in frame sides), ``area`` float32 [T] (frame sides squared); with its bright
    pixels ``bright`` [T, H, W] also ``texture`` (see :func:`_texture_reading`)."""
    frames, height, width = mask.shape
    weight = mask.float()
    area = weight.flatten(1).sum(1).clamp_min(1)
    xs = (torch.arange(width, dtype=torch.float32) + 0.5).view(1, 1, -1)
    ys = (torch.arange(height, dtype=torch.float32) + 0.5).view(1, -1, 1)
    cx = (weight * xs).flatten(1).sum(1) / area
    cy = (weight * ys).flatten(1).sum(1) / area
    spread = (weight * ((xs - cx.view(-1, 1, 1)) ** 2 + (ys - cy.view(-1, 1, 1)) ** 2)).flatten(1).sum(1) / area
    track = {"visible": _visible(mask, side), "area": weight.flatten(1).sum(1) / side ** 2,
             "centre": torch.stack([cx / width, cy / height], -1), "radius": torch.sqrt(2 * spread) / side}
    if bright is not None and track["visible"].any():
        radius_px = float(track["radius"][track["visible"]].median()) * side
        track["texture"] = _texture_reading(bright & track["visible"].view(-1, 1, 1), radius_px)
    return track


def _crop(mask: torch.Tensor, margin: int) -> torch.Tensor:
    """``mask`` bool [T, H, W] cut to the box holding all its pixels in every frame, plus ``margin``."""
    rows = torch.nonzero(mask.any(0).any(1)).flatten()
    cols = torch.nonzero(mask.any(0).any(0)).flatten()
    if len(rows) == 0:
        return mask
    top, left = max(0, int(rows[0]) - margin), max(0, int(cols[0]) - margin)
    return mask[:, top:int(rows[-1]) + margin + 1, left:int(cols[-1]) + margin + 1]


def _texture_reading(bright: torch.Tensor, radius_px: float) -> tuple[float, float] | None:
    """(dark fraction, across share) of an object from its bright pixels ``bright`` bool [T, H, W] and its
    radius in pixels, or None where too few pixels show. The object's inside is the bright pixels closed
    over gaps of 0.4 radius (the dark stripes / squares; the hole of a ring is wider) and eroded by one
    more pixel (anti-aliased edges); the dark fraction is the median over frames of the share of that
    inside which is not bright, the across share the fraction of bright/dark changes inside between
    horizontal neighbours (0 for stripes, which are horizontal; 0.5 for checks)."""
    reach = max(1, math.ceil(0.2 * radius_px))
    bright = _crop(bright, reach + 2)
    inside = ~_dilate(~_dilate(bright, reach), reach + 1)
    pixels = inside.flatten(1).sum(1)
    readable = pixels >= TEXTURE_PIXELS
    if int(readable.sum()) < 2:
        return None
    dark = ((inside & ~bright).flatten(1).sum(1)[readable] / pixels[readable]).median()
    level = bright.float()
    across = ((level[:, :, 1:] - level[:, :, :-1]).abs() * (inside[:, :, 1:] & inside[:, :, :-1]))[readable].sum()
    down = ((level[:, 1:] - level[:, :-1]).abs() * (inside[:, 1:] & inside[:, :-1]))[readable].sum()
    return float(dark), float(across / (across + down).clamp_min(1))


def _object_scores(track: dict | None, caption_object: tuple[int, int, int, int, int]) -> dict:
    """Colour, size and motion scores of one captioned object given its ``track`` (None: not found)."""
    size, _, texture, _, motion = caption_object
    if track is None or int(track["visible"].sum()) < 2:
        return {"colour": 0.0, "size": 0.0, "motion": 0.0, "texture": 0.0, "motion_reading": None, "total": 0.0}
    visible = track["visible"]
    colour = min(1.0, float(visible.float().mean()) / VISIBLE_FRAMES)
    radius = float(track["radius"][visible].median())
    big = 1 / (1 + math.exp(-(radius - SIZE_BORDER) / SIZE_WIDTH))
    size_score = big if size == 1 else 1 - big
    # Frames where most of the object shows: a partly hidden object's centroid is off its centre.
    area = track["area"][visible]
    whole = area >= WHOLE_AREA * torch.quantile(area, 0.9)
    centre = track["centre"][visible][whole]
    memberships, net, path = _motion_memberships(centre)
    motion_score = float(memberships[motion] / memberships.sum().clamp_min(1))
    reading = {"net": net.tolist(), "path": float(path), "memberships": memberships.tolist()}
    scores = {"colour": colour, "size": size_score, "motion": motion_score, "texture": None,
              "motion_reading": reading}
    if track.get("texture") is not None:
        dark, across = track["texture"]
        textured = float(_ramp(dark, *TEXTURE_DARK_FRACTION))
        checks = float(_ramp(across, *TEXTURE_ACROSS))
        scores["texture"] = (1 - textured, textured * (1 - checks), textured * checks)[texture]
    scores["total"] = colour + size_score + motion_score + (scores["texture"] or 0.0)
    return scores


def _ramp(value: torch.Tensor | float, low: float, high: float) -> torch.Tensor:
    """0 below ``low``, 1 above ``high``, linear between."""
    return ((torch.as_tensor(value) - low) / (high - low)).clamp(0, 1)


# Unit direction [4, 2] (frame fractions, y down) of the slides, grammar.MOTIONS[:4]: left, right, up, down.
SLIDE_DIRECTIONS = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, -1.0], [0.0, 1.0]])


def _motion_memberships(centre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fuzzy memberships float32 [6] of a centroid track ``centre`` [N, 2] (N >= 2 visible frames, in
    frame fractions, y down) in the motions of ``grammar.MOTIONS``: left, right, up, down, bouncing,
    circling; with the net displacement [2] and path length [] they are read from."""
    net, path = centre[-1] - centre[0], (centre[1:] - centre[:-1]).norm(dim=-1).sum()
    straight = net.norm() / path.clamp_min(1e-6)
    sweep, fit_error = _circle_sweep(centre)
    circling = _ramp(sweep, 3.0, 4.0) * (1 - _ramp(fit_error, 0.08, 0.15)) * _ramp(path, 0.3, 0.45)
    bouncing = _ramp(path, 0.6, 0.85) * (1 - circling)
    along = SLIDE_DIRECTIONS @ net
    across = (net - along.unsqueeze(-1) * SLIDE_DIRECTIONS).norm(dim=-1)
    slides = _ramp(along, 0.1, 0.18) * (1 - _ramp(across / along.abs().clamp_min(1e-6), 0.3, 0.6)) \
        * _ramp(straight, 0.4, 0.7) * (1 - _ramp(path, 0.6, 0.85))
    return torch.cat([slides, bouncing.view(1), circling.view(1)]), net, path


def _circle_sweep(centre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Angle (radians, unsigned) that the track ``centre`` [N, 2] sweeps around its least-squares circle,
    and the rms distance of the track from that circle relative to its radius (inf if no circle fits)."""
    if len(centre) < 4:
        return torch.tensor(0.0), torch.tensor(float("inf"))
    x, y = centre[:, 0].double(), centre[:, 1].double()
    system = torch.stack([x, y, torch.ones_like(x)], -1)
    solution = torch.linalg.lstsq(system, (x * x + y * y).unsqueeze(-1)).solution.squeeze(-1)
    cx, cy = solution[0] / 2, solution[1] / 2
    radius_sq = solution[2] + cx * cx + cy * cy
    if not torch.isfinite(radius_sq) or radius_sq <= 0:
        return torch.tensor(0.0), torch.tensor(float("inf"))
    radius = radius_sq.sqrt()
    distance = torch.sqrt((x - cx) ** 2 + (y - cy) ** 2)
    error = ((distance - radius).pow(2).mean().sqrt() / radius).float()
    angle = torch.atan2(y - cy, x - cx)
    turn = torch.remainder(angle[1:] - angle[:-1] + math.pi, 2 * math.pi) - math.pi
    return turn.sum().abs().float(), error
