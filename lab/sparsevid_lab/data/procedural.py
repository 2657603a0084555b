"""Procedural captioned videos, generated on the fly and reproducible from a seed.

Each clip shows 1..max_objects shapes (circle, square, diamond, ring) of different colours, sizes and
textures moving over a shaded background: sliding left/right/up/down, bouncing off the walls, or
circling. Objects are drawn in order, so later objects occlude earlier ones. The caption (see
:mod:`sparsevid_lab.data.grammar`) names every object and the background.

With ``background_texture > 0`` the background carries a smooth random texture (a sum of sinusoidal
gratings at several scales) that modulates its brightness, and with ``pan > 0`` the texture slides as
under a panning camera. Real video has texture everywhere; large flat backgrounds make many keys and
values identical and spread attention evenly over them. The caption does not change: the background's
colour is its base colour, which the texture only brightens and darkens around.

A narrower scene distribution (a *slice*, e.g. fine-tuning data unlike the pre-training data) restricts the
backgrounds, colours and motions a clip may draw (``backgrounds=("navy",)``, ``motions=("moving left",
"moving right")``) and the number of objects (``max_objects``); :meth:`ProceduralVideos.fits` tells whether a
caption could come from a slice, so captions held out from it can be chosen (:func:`held_out_captions`).
Every caption of a slice is a caption of the full grammar, so the faithfulness scorer checks it as any other.

Scene parameters are drawn on the CPU from a ``torch.Generator`` (so a seed gives the same clips on
every device); rendering is vectorised over the batch and frames and runs on any device.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import grammar

COLOUR_RGB = torch.tensor([
    [0.90, 0.15, 0.10], [0.15, 0.80, 0.20], [0.15, 0.30, 0.95], [0.95, 0.90, 0.15],
    [0.10, 0.85, 0.90], [0.90, 0.15, 0.85], [1.00, 0.55, 0.05], [0.95, 0.95, 0.95],
])
BACKGROUND_RGB = torch.tensor([[0.04, 0.04, 0.05], [0.45, 0.45, 0.47], [0.06, 0.09, 0.30], [0.82, 0.76, 0.62]])
RADIUS_RANGE = ((0.08, 0.10), (0.14, 0.17))  # per size word, in frame widths
TEXTURE_DARK = 0.35  # brightness of the dark stripes / squares of textured objects
BACKGROUND_WAVES = 8  # sinusoidal gratings summed into a background texture
WAVE_CYCLES = (1.5, 7.0)  # their spatial frequencies, in cycles per frame width
assert len(COLOUR_RGB) == len(grammar.COLOURS) and len(BACKGROUND_RGB) == len(grammar.BACKGROUNDS)


@dataclass(frozen=True)
class Scenes:
    """Parameters of a batch of B clips with up to K objects, all on the CPU.

    present bool [B, K]; size, colour, texture, shape, motion int64 [B, K] (indices into the grammar's
    word lists); radius float32 [B, K] (frame widths); centre float32 [B, K, T, 2] ((x, y) per frame,
    in [0, 1], y pointing down); background int64 [B]. For a textured background, waves float32
    [B, W, 4] holds each grating's (x frequency, y frequency, phase, amplitude) and pan float32 [B, 2]
    the texture's displacement over the whole clip (frame widths); both are None for plain backgrounds.
    """

    present: torch.Tensor
    size: torch.Tensor
    colour: torch.Tensor
    texture: torch.Tensor
    shape: torch.Tensor
    motion: torch.Tensor
    radius: torch.Tensor
    centre: torch.Tensor
    background: torch.Tensor
    waves: torch.Tensor | None = None
    pan: torch.Tensor | None = None

    def captions(self) -> list[str]:
        """One caption per clip, objects in drawing order."""
        result = []
        for b in range(self.present.shape[0]):
            objects = [(int(self.size[b, k]), int(self.colour[b, k]), int(self.texture[b, k]),
                        int(self.shape[b, k]), int(self.motion[b, k]))
                       for k in range(self.present.shape[1]) if self.present[b, k]]
            result.append(grammar.caption_text(objects, int(self.background[b])))
        return result


def _reflect(u: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Fold positions ``u`` into [lo, hi] as a ball bouncing off both walls would."""
    span = hi - lo
    w = torch.remainder(u - lo, 2 * span)
    return lo + span - (w - span).abs()


def _uniform(gen: torch.Generator, shape, lo, hi) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=gen)


def _paths(motion: torch.Tensor, radius: torch.Tensor, frames: int, gen: torch.Generator) -> torch.Tensor:
    """Object centres float32 [B, K, T, 2] for motion indices [B, K] and radii [B, K]."""
    shape = motion.shape
    tau = torch.linspace(0.0, 1.0, frames).view(1, 1, frames)
    r = radius.unsqueeze(-1)
    lo, hi = r, 1.0 - r
    # Sliding (motions 0..3: left, right, up, down): distance D along one axis, staying inside the frame.
    distance = _uniform(gen, shape, 0.25, 0.45).unsqueeze(-1)
    sign = torch.where(motion % 2 == 0, -1.0, 1.0).unsqueeze(-1)
    start = lo + torch.rand(shape, generator=gen).unsqueeze(-1) * (hi - lo - distance)
    start = torch.where(sign < 0, start + distance, start)
    along = start + sign * distance * tau
    across = (lo + torch.rand(shape, generator=gen).unsqueeze(-1) * (hi - lo)).expand_as(along)
    horizontal = (motion < 2).unsqueeze(-1)
    slide = torch.stack([torch.where(horizontal, along, across), torch.where(horizontal, across, along)], -1)
    # Bouncing: a fast straight path folded back at the walls.
    speed = _uniform(gen, shape, 1.0, 1.8).unsqueeze(-1)
    angle = _uniform(gen, shape, 0.0, 2 * math.pi).unsqueeze(-1)
    x0 = lo + torch.rand(shape, generator=gen).unsqueeze(-1) * (hi - lo)
    y0 = lo + torch.rand(shape, generator=gen).unsqueeze(-1) * (hi - lo)
    bounce = torch.stack([_reflect(x0 + speed * torch.cos(angle) * tau, lo, hi),
                          _reflect(y0 + speed * torch.sin(angle) * tau, lo, hi)], -1)
    # Circling: most of a turn around a centre chosen so the whole orbit stays inside the frame.
    orbit = _uniform(gen, shape, 0.12, 0.22).unsqueeze(-1)
    cx = lo + orbit + torch.rand(shape, generator=gen).unsqueeze(-1) * (hi - lo - 2 * orbit)
    cy = lo + orbit + torch.rand(shape, generator=gen).unsqueeze(-1) * (hi - lo - 2 * orbit)
    turn = (torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
            * _uniform(gen, shape, 0.75, 1.0)).unsqueeze(-1)
    phase = _uniform(gen, shape, 0.0, 2 * math.pi).unsqueeze(-1) + 2 * math.pi * turn * tau
    circle = torch.stack([cx + orbit * torch.cos(phase), cy + orbit * torch.sin(phase)], -1)
    m = motion.view(*shape, 1, 1)
    return torch.where(m < 4, slide, torch.where(m == 4, bounce, circle)).float()


SLICE_FIELDS = {"backgrounds": grammar.BACKGROUNDS, "colours": grammar.COLOURS, "motions": grammar.MOTIONS}


def _allowed(name: str, words, vocabulary: tuple[str, ...]) -> tuple[str, ...] | None:
    """``words`` (None: every word of ``vocabulary``) checked and put in vocabulary order; None if all."""
    if words is None:
        return None
    if isinstance(words, str) or not all(isinstance(w, str) for w in words):
        raise TypeError(f"{name} must be a list of words such as {list(vocabulary[:2])}, got {words!r}")
    unknown = [w for w in words if w not in vocabulary]
    if unknown or not words:
        raise ValueError(f"{name} must be a non-empty list of {', '.join(repr(v) for v in vocabulary)}; "
                         f"got {list(words)!r}" + (f" (unknown: {unknown})" if unknown else ""))
    chosen = tuple(v for v in vocabulary if v in words)
    return None if len(chosen) == len(vocabulary) else chosen


class ProceduralVideos:
    """Generator of captioned clips: video float32 [B, 3, T, H, W] in [-1, 1] and their captions.

    Args:
        frames, height, width: clip size T x H x W.
        max_objects: clips hold 1..max_objects objects (uniformly many).
        backgrounds, colours, motions: the words clips may draw (a slice of the grammar; None: all of them).
        background_texture: strength of the background texture in [0, 1] (0: smooth shading only): the
            background moves up to this fraction of the way towards white or black around its base colour.
        pan: largest displacement of the background texture over a clip, in frame widths (camera pan);
            each clip draws a direction and a distance up to it. Needs ``background_texture > 0``.
    """

    def __init__(self, frames: int = 16, height: int = 64, width: int = 64, max_objects: int = 3,
                 background_texture: float = 0.0, pan: float = 0.0, backgrounds=None, colours=None, motions=None):
        for name, value in (("frames", frames), ("height", height), ("width", width), ("max_objects", max_objects)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if frames < 2:
            raise ValueError(f"frames must be at least 2 to show motion, got {frames}")
        for name, value, high in (("background_texture", background_texture, 1.0), ("pan", pan, 2.0)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= high:
                raise ValueError(f"{name} must be a number in [0, {high}], got {value!r}")
        if pan > 0 and background_texture == 0:
            raise ValueError("pan moves the background texture: it needs background_texture > 0")
        self.frames, self.height, self.width, self.max_objects = frames, height, width, max_objects
        self.background_texture, self.pan = float(background_texture), float(pan)
        self.caption_length = grammar.max_caption_words(max_objects)
        # Per slice field: the allowed words, or None for the whole word list.
        self.slice = {name: _allowed(name, value, SLICE_FIELDS[name])
                      for name, value in (("backgrounds", backgrounds), ("colours", colours), ("motions", motions))}
        # Index into the grammar's word list of each allowed word, int64 [n] (None: all words allowed).
        self._choices = {name: None if words is None else torch.tensor([SLICE_FIELDS[name].index(w) for w in words])
                         for name, words in self.slice.items()}

    def config(self) -> dict:
        config = {"frames": self.frames, "height": self.height, "width": self.width, "max_objects": self.max_objects}
        if self.background_texture > 0:
            config.update(background_texture=self.background_texture, pan=self.pan)
        config.update({name: list(words) for name, words in self.slice.items() if words is not None})
        return config

    def _draw(self, name: str, shape, generator: torch.Generator) -> torch.Tensor:
        """Grammar indices int64 ``shape`` of field ``name``, uniform over its allowed words (with every word
        allowed, the same draws as an unrestricted generator)."""
        choices = self._choices[name]
        if choices is None:
            return torch.randint(len(SLICE_FIELDS[name]), shape, generator=generator)
        return choices[torch.randint(len(choices), shape, generator=generator)]

    def sample_scenes(self, batch: int, generator: torch.Generator) -> Scenes:
        """Draw the parameters of ``batch`` clips from ``generator`` (a CPU generator)."""
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
            raise TypeError("generator must be a CPU torch.Generator")
        shape = (batch, self.max_objects)
        count = torch.randint(1, self.max_objects + 1, (batch, 1), generator=generator)
        present = torch.arange(self.max_objects).unsqueeze(0) < count
        size = torch.randint(len(grammar.SIZES), shape, generator=generator)
        colour = self._draw("colours", shape, generator)
        texture = torch.randint(len(grammar.TEXTURES), shape, generator=generator)
        kind = torch.randint(len(grammar.SHAPES), shape, generator=generator)
        motion = self._draw("motions", shape, generator)
        background = self._draw("backgrounds", (batch,), generator)
        bounds = torch.tensor(RADIUS_RANGE)[size]
        radius = bounds[..., 0] + (bounds[..., 1] - bounds[..., 0]) * torch.rand(shape, generator=generator)
        centre = _paths(motion, radius, self.frames, generator)
        waves = pan = None
        if self.background_texture > 0:  # drawn last, so plain-background scenes stay as they were
            waves, pan = self._background_motion(batch, generator)
        return Scenes(present, size, colour, texture, kind, motion, radius, centre, background, waves, pan)

    def _background_motion(self, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random gratings float32 [B, W, 4] (fx, fy, phase, amplitude) and pan float32 [B, 2]."""
        shape = (batch, BACKGROUND_WAVES)
        cycles = torch.exp(_uniform(gen, shape, math.log(WAVE_CYCLES[0]), math.log(WAVE_CYCLES[1])))
        angle = _uniform(gen, shape, 0.0, 2 * math.pi)
        phase = _uniform(gen, shape, 0.0, 2 * math.pi)
        amplitude = 1.0 / cycles  # coarse gratings dominate, as in natural images
        amplitude = amplitude / amplitude.sum(-1, keepdim=True)
        waves = torch.stack([cycles * torch.cos(angle), cycles * torch.sin(angle), phase, amplitude], -1)
        direction = _uniform(gen, (batch,), 0.0, 2 * math.pi)
        distance = self.pan * torch.rand(batch, generator=gen)
        pan = torch.stack([distance * torch.cos(direction), distance * torch.sin(direction)], -1)
        return waves, pan

    def render(self, scenes: Scenes, device: torch.device | str = "cpu") -> torch.Tensor:
        """Draw ``scenes``: float32 [B, 3, T, H, W] in [-1, 1] on ``device``."""
        b = scenes.present.shape[0]
        ys = (torch.arange(self.height, device=device, dtype=torch.float32) + 0.5) / self.height
        xs = (torch.arange(self.width, device=device, dtype=torch.float32) + 0.5) / self.width
        shade = (1.15 - 0.3 * ys).view(1, 1, 1, -1, 1)
        video = BACKGROUND_RGB[scenes.background].to(device).view(b, 3, 1, 1, 1) * shade
        video = video.expand(b, 3, self.frames, self.height, self.width)
        if scenes.waves is not None:
            texture = self._background_texture(scenes.waves.to(device), scenes.pan.to(device), xs, ys).unsqueeze(1)
            # Brighten towards white where the texture is positive, darken towards black where it is
            # negative: the values stay in range and the base colour is the median.
            lift = self.background_texture * texture
            video = torch.where(lift > 0, video + lift * (1 - video), video * (1 + lift))
        video = video.clamp(0, 1)
        # Every scene tensor moves to the device once, not once per object.
        centre, radius, kinds, present, textures = (t.to(device) for t in (
            scenes.centre, scenes.radius, scenes.shape, scenes.present, scenes.texture))
        colours = COLOUR_RGB[scenes.colour].to(device)  # [B, K, 3]
        pixel = float(min(self.height, self.width))
        for k in range(self.max_objects):
            r = radius[:, k].view(b, 1, 1, 1)
            dx = (xs.view(1, 1, 1, -1) - centre[:, k, :, 0].view(b, -1, 1, 1)) * (self.width / pixel)
            dy = (ys.view(1, 1, -1, 1) - centre[:, k, :, 1].view(b, -1, 1, 1)) * (self.height / pixel)
            alpha = self._coverage(kinds[:, k].view(b, 1, 1, 1), dx, dy, r, pixel)
            alpha = alpha * present[:, k].view(b, 1, 1, 1)
            tex = self._texture(textures[:, k].view(b, 1, 1, 1), dx, dy, r)
            colour = colours[:, k].view(b, 3, 1, 1, 1)
            alpha = alpha.unsqueeze(1)
            video = video * (1 - alpha) + alpha * colour * tex.unsqueeze(1)
        return video * 2 - 1

    def object_mask(self, scenes: Scenes, video: torch.Tensor) -> torch.Tensor:
        """Where the objects of ``scenes`` show in ``video`` (their render, [B, 3, T, H, W]): bool [B, 1, T, H, W],
        the pixels that differ from the same scenes rendered without objects."""
        empty = self.render(dataclasses.replace(scenes, present=torch.zeros_like(scenes.present)), video.device)
        return (video - empty).abs().sum(1, keepdim=True) > 1e-3

    def _background_texture(self, waves: torch.Tensor, pan: torch.Tensor, xs: torch.Tensor,
                            ys: torch.Tensor) -> torch.Tensor:
        """Texture in about [-1, 1], float32 [B, T, H, W]: the gratings ``waves`` [B, W, 4] shifted by
        ``pan`` [B, 2] times the clip's progress (pixel coordinates ``xs`` [W], ``ys`` [H] in [0, 1])."""
        tau = torch.linspace(0.0, 1.0, self.frames, device=xs.device).view(1, -1, 1)
        # Pixel coordinates under the pan, shared by every grating.
        x = xs.view(1, 1, -1) - pan[:, 0].view(-1, 1, 1) * tau                              # [B, T, W]
        y = ys.view(1, 1, -1) * (self.height / self.width) - pan[:, 1].view(-1, 1, 1) * tau  # [B, T, H]
        total = 0.0
        # One grating at a time keeps the peak memory at one [B, T, H, W] tensor.
        for wave in waves.unbind(1):
            fx, fy, phase, amplitude = (v.view(-1, 1, 1) for v in wave.unbind(-1))  # [B, 1, 1]
            angle = (2 * math.pi * fx * x).unsqueeze(2) + (2 * math.pi * fy * y).unsqueeze(3) + phase.unsqueeze(-1)
            total = total + amplitude.unsqueeze(-1) * torch.sin(angle)
        return (total * 2.0).clamp(-1, 1)  # the amplitudes sum to 1: this spreads the sum over [-1, 1]

    @staticmethod
    def _coverage(kind, dx, dy, r, pixel: float) -> torch.Tensor:
        """Anti-aliased coverage in [0, 1], [B, T, H, W], from the signed distance of each shape kind."""
        dist = torch.sqrt(dx * dx + dy * dy)
        inside = torch.where(kind == 0, r - dist,                                       # circle
                 torch.where(kind == 1, r * 0.85 - torch.maximum(dx.abs(), dy.abs()),   # square
                 torch.where(kind == 2, (r * 1.2 - dx.abs() - dy.abs()) / math.sqrt(2),  # diamond
                             torch.minimum(r - dist, dist - 0.55 * r))))                 # ring
        return (inside * pixel + 0.5).clamp(0, 1)

    @staticmethod
    def _texture(texture, dx, dy, r) -> torch.Tensor:
        """Brightness factor [B, T, H, W] of plain (1), striped and checkered objects, moving with them."""
        period = 0.8 * r
        stripes = torch.sin(2 * math.pi * dy / period) > 0
        checks = stripes ^ (torch.sin(2 * math.pi * dx / period) > 0)
        dark = torch.where(texture == 1, ~stripes, torch.where(texture == 2, checks, torch.zeros_like(checks)))
        return torch.where(dark, TEXTURE_DARK, 1.0)

    def sample(self, batch: int, generator: torch.Generator, device: torch.device | str = "cpu"):
        """``batch`` clips: (video float32 [B, 3, T, H, W] in [-1, 1] on ``device``, captions list[str])."""
        scenes = self.sample_scenes(batch, generator)
        return self.render(scenes, device), scenes.captions()

    def fits(self, caption: str) -> bool:
        """Whether this dataset could have drawn ``caption``: at most ``max_objects`` objects and
        ``caption_length`` words, and (in a slice) only allowed backgrounds, colours and motions."""
        if len(caption.split()) > self.caption_length or caption.count(" and ") >= self.max_objects:
            return False
        if all(words is None for words in self.slice.values()):
            return True
        objects, background = grammar.parse_caption(caption)
        used = {"backgrounds": {grammar.BACKGROUNDS[background]},
                "colours": {grammar.COLOURS[o[1]] for o in objects},
                "motions": {grammar.MOTIONS[o[4]] for o in objects}}
        return all(words is None or used[name] <= set(words) for name, words in self.slice.items())

    def tokenize(self, captions: list[str] | str) -> torch.Tensor:
        """Word ids int64 [B, caption_length] of ``captions`` (see :func:`grammar.tokenize`)."""
        return grammar.tokenize(captions, self.caption_length)


def held_out_captions(data: ProceduralVideos, excluded: ProceduralVideos, count: int, seed: int = 0) -> list[str]:
    """``count`` distinct captions that ``data`` draws but ``excluded`` (e.g. a fine-tuning slice) could not
    have drawn (``not excluded.fits(caption)``), in the order ``data`` draws them from ``seed``."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    generator = torch.Generator().manual_seed(seed)
    captions: list[str] = []
    for _ in range(1000):
        for caption in data.sample_scenes(64, generator).captions():
            if not excluded.fits(caption) and caption not in captions:
                captions.append(caption)
                if len(captions) == count:
                    return captions
    raise ValueError(f"found only {len(captions)} of {count} captions that the data draw and the excluded "
                     f"slice cannot: the two distributions (nearly) coincide")
