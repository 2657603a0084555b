"""The procedural video dataset: determinism, value ranges, caption grammar, captions agreeing with clips."""
import dataclasses

import pytest
import torch

from sparsevid_lab.data import ProceduralVideos, grammar
from sparsevid_lab.data.procedural import COLOUR_RGB


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_same_seed_same_clips_and_captions():
    data = ProceduralVideos(frames=6, height=24, width=32)
    v1, c1 = data.sample(5, _gen(3))
    v2, c2 = data.sample(5, _gen(3))
    v3, c3 = data.sample(5, _gen(4))
    assert torch.equal(v1, v2) and c1 == c2
    assert not torch.equal(v1, v3) and c1 != c3


@pytest.mark.parametrize("frames,height,width", [(16, 64, 64), (4, 16, 16), (5, 20, 36)],
                         ids=["default", "tiny", "odd"])
def test_shapes_and_range(frames, height, width):
    data = ProceduralVideos(frames=frames, height=height, width=width)
    video, captions = data.sample(8, _gen(0))
    assert video.shape == (8, 3, frames, height, width) and video.dtype == torch.float32
    assert video.min() >= -1 and video.max() <= 1 and torch.isfinite(video).all()
    assert len(captions) == 8
    assert video.std() > 0.1  # not a blank clip


def test_clips_move():
    video, _ = ProceduralVideos().sample(8, _gen(1))
    change = (video[:, :, -1] - video[:, :, 0]).abs().flatten(1).amax(1)
    assert (change > 0.5).all()


def test_captions_follow_the_grammar_and_tokenize():
    data = ProceduralVideos(max_objects=3)
    _, captions = data.sample(64, _gen(2))
    counts = set()
    for caption in captions:
        objects, background = caption.rsplit(" on a ", 1)
        assert background.split()[0] in grammar.BACKGROUNDS and background.endswith("background")
        phrases = objects.split(" and ")
        counts.add(len(phrases))
        for phrase in phrases:
            words = phrase.split()
            assert words[0] in grammar.SIZES and words[1] in grammar.COLOURS
            assert words[2] in grammar.TEXTURES and words[3] in grammar.SHAPES
            assert " ".join(words[4:]) in grammar.MOTIONS
    assert counts == {1, 2, 3}
    tokens = data.tokenize(captions)
    assert tokens.shape == (64, data.caption_length) and tokens.dtype == torch.long
    assert (tokens[:, 0] != grammar.PAD_ID).all()
    decoded = [" ".join(grammar.VOCAB[i] for i in row if i != grammar.PAD_ID) for row in tokens.tolist()]
    assert decoded == captions


def test_null_caption_and_bad_captions():
    assert (grammar.tokenize("", 8) == grammar.PAD_ID).all()
    with pytest.raises(ValueError, match="vocabulary"):
        grammar.tokenize("a purple circle", 8)
    with pytest.raises(ValueError, match="length"):
        grammar.tokenize("big red plain circle bouncing on a black background", 4)
    with pytest.raises(TypeError, match="captions"):
        grammar.tokenize([3], 8)


@pytest.mark.parametrize("kwargs", [{"frames": 1}, {"height": 0}, {"max_objects": 0}, {"width": 2.5}])
def test_bad_sizes(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ProceduralVideos(**kwargs)


def _object_pixels(data, scenes):
    """bool [B, T, H, W]: where a clip differs from its background alone."""
    empty = dataclasses.replace(scenes, present=torch.zeros_like(scenes.present))
    return (data.render(scenes) - data.render(empty)).abs().sum(1) > 0.1


def test_caption_motion_matches_the_clip():
    """The centroid of a single object moves the way its caption says."""
    data = ProceduralVideos(frames=8, height=64, width=64, max_objects=1)
    scenes = data.sample_scenes(64, _gen(7))
    mask = _object_pixels(data, scenes).float()
    ys, xs = torch.arange(64.0).view(1, 1, -1, 1), torch.arange(64.0).view(1, 1, 1, -1)
    area = mask.sum((2, 3))
    cx, cy = (mask * xs).sum((2, 3)) / area, (mask * ys).sum((2, 3)) / area
    dx, dy = cx[:, -1] - cx[:, 0], cy[:, -1] - cy[:, 0]
    seen = set()
    for b, caption in enumerate(scenes.captions()):
        motion = " ".join(caption.split(" on a ")[0].split()[4:])
        seen.add(motion)
        expected = {"moving left": dx[b] < -10, "moving right": dx[b] > 10, "moving up": dy[b] < -10,
                    "moving down": dy[b] > 10}.get(motion, (mask[b, 1:] != mask[b, :-1]).any())
        assert expected, (caption, float(dx[b]), float(dy[b]))
        if motion.startswith("moving"):  # sliding keeps the other coordinate fixed
            other = dy[b] if motion in ("moving left", "moving right") else dx[b]
            assert abs(float(other)) < 1.0, caption
    assert seen == set(grammar.MOTIONS)


def test_caption_colour_and_size_match_the_clip():
    """A plain object's pixels have the colour its caption names; big objects cover more pixels."""
    data = ProceduralVideos(frames=2, height=64, width=64, max_objects=1)
    scenes = data.sample_scenes(48, _gen(5))
    scenes = dataclasses.replace(scenes, texture=torch.zeros_like(scenes.texture))
    video = data.render(scenes)
    area = _object_pixels(data, scenes)[:, 0].sum((1, 2))
    areas = {"small": [], "big": []}
    for b, caption in enumerate(scenes.captions()):
        size, colour, _, shape = caption.split()[:4]
        areas[size].append(float(area[b]) / {"circle": 1.0, "square": 1.16, "diamond": 0.92, "ring": 0.7}[shape])
        if shape == "ring":  # a ring's centre shows the background
            continue
        x, y = (scenes.centre[b, 0, 0] * 64).long().tolist()
        pixel = (video[b, :, 0, y, x] + 1) / 2
        assert torch.allclose(pixel, COLOUR_RGB[grammar.COLOURS.index(colour)], atol=1e-4), caption
    assert max(areas["small"]) < min(areas["big"])


def test_textured_background_keeps_plain_scenes_and_its_base_colour():
    plain, captions = ProceduralVideos(frames=6, height=32, width=32).sample(6, _gen(5))
    data = ProceduralVideos(frames=6, height=32, width=32, background_texture=0.5, pan=0.4)
    textured, textured_captions = data.sample(6, _gen(5))
    assert textured_captions == captions  # the texture is drawn after everything the caption names
    assert textured.min() >= -1 and textured.max() <= 1 and torch.isfinite(textured).all()
    # Where no object is, the texture varies the background around its shaded base colour.
    background = (plain - textured).abs().amax(1) > 0
    assert background.float().mean() > 0.3
    base = plain.permute(0, 2, 3, 4, 1)[background]
    varied = textured.permute(0, 2, 3, 4, 1)[background]
    assert (varied - base).abs().mean() > 0.05
    assert (varied - base).median(0).values.abs().max() < 0.05


def test_pan_moves_the_background_texture():
    still = ProceduralVideos(frames=8, height=32, width=32, background_texture=0.5)
    panning = ProceduralVideos(frames=8, height=32, width=32, background_texture=0.5, pan=1.0)
    scenes = still.sample_scenes(4, _gen(7))
    still_video = still.render(dataclasses.replace(scenes, present=torch.zeros_like(scenes.present)))
    assert torch.equal(still_video[:, :, 0], still_video[:, :, -1])  # no pan: the texture stays put
    scenes = panning.sample_scenes(4, _gen(7))
    moving = panning.render(dataclasses.replace(scenes, present=torch.zeros_like(scenes.present)))
    assert ((moving[:, :, 0] - moving[:, :, -1]).abs().flatten(1).amax(1) > 0.1).all()


@pytest.mark.parametrize("kwargs", [dict(background_texture=-0.1), dict(background_texture=1.5),
                                    dict(pan=0.5), dict(background_texture=0.5, pan=3.0),
                                    dict(background_texture="0.5")], ids=["neg", "big", "pan-plain", "pan-big", "str"])
def test_bad_background_options_are_rejected(kwargs):
    with pytest.raises(ValueError):
        ProceduralVideos(**kwargs)


def test_a_slice_draws_only_its_words_and_fits_only_its_captions():
    from sparsevid_lab.data import held_out_captions
    from sparsevid_lab.data.grammar import parse_caption

    full = ProceduralVideos(max_objects=3)
    narrow = ProceduralVideos(max_objects=1, backgrounds=["navy"], colours=["red", "blue"],
                              motions=["moving left", "moving right"])
    captions = narrow.sample_scenes(64, torch.Generator().manual_seed(0)).captions()
    for caption in captions:
        objects, background = parse_caption(caption)
        assert background == 2 and len(objects) == 1 and objects[0][1] in (0, 2) and objects[0][4] in (0, 1)
        assert narrow.fits(caption) and full.fits(caption)
    assert {parse_caption(c)[0][0][4] for c in captions} == {0, 1}  # both motions drawn
    for caption in ("big red plain circle moving left on a black background",  # another background
                    "big green plain circle moving left on a navy background",  # another colour
                    "big red plain circle bouncing on a navy background",  # another motion
                    "big red plain circle moving left and small blue plain ring moving right on a navy background"):
        assert not narrow.fits(caption) and full.fits(caption)
    held_out = held_out_captions(full, narrow, 6, seed=3)
    assert len(set(held_out)) == 6 and not any(narrow.fits(c) for c in held_out)
    assert ProceduralVideos(**narrow.config()).config() == narrow.config()  # the config rebuilds the slice


def test_allowing_every_word_draws_the_unrestricted_clips():
    from sparsevid_lab.data import grammar

    plain = ProceduralVideos().sample(3, torch.Generator().manual_seed(4))
    listed = ProceduralVideos(colours=list(grammar.COLOURS), motions=list(grammar.MOTIONS)).sample(
        3, torch.Generator().manual_seed(4))
    assert torch.equal(plain[0], listed[0]) and plain[1] == listed[1]
    assert "colours" not in ProceduralVideos(colours=list(grammar.COLOURS)).config()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(backgrounds=["purple"]), ValueError, "backgrounds must be.*purple"),
    (dict(motions=[]), ValueError, "motions must be a non-empty"),
    (dict(colours="red"), TypeError, "colours must be a list"),
], ids=["unknown-word", "empty", "string"])
def test_bad_slices_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        ProceduralVideos(**kwargs)


def test_held_out_triples_skip_the_slice():
    from sparsevid_lab.data.sources import ProceduralSource
    from sparsevid_lab.eval.heldout import HELDOUT_SEED, heldout_set
    from sparsevid_lab.model.builtin import BuiltinVideoDiT, tiny_config

    model = BuiltinVideoDiT(tiny_config())
    full = ProceduralVideos(frames=2, height=8, width=8, max_objects=2)
    narrow = ProceduralVideos(frames=2, height=8, width=8, max_objects=2, backgrounds=["navy", "black"])
    plain = heldout_set(model, full, per_bin=2, num_bins=2)
    skipped = heldout_set(model, full, per_bin=2, num_bins=2, exclude=narrow)
    captions = ProceduralSource(full, seed=HELDOUT_SEED).captions
    plain_captions, skipped_captions = captions(list(plain.indices)), captions(list(skipped.indices))
    assert not any(narrow.fits(c) for c in skipped_captions)
    assert skipped.bins.tolist() == plain.bins.tolist() == [0, 1, 0, 1]
    assert all(lo <= t < hi for t, b in zip(skipped.t.tolist(), skipped.bins.tolist())
               for lo, hi in [(b / 2, (b + 1) / 2)])
    first = next(i for i, c in enumerate(plain_captions) if not narrow.fits(c))
    assert skipped.indices[0] == plain.indices[first]  # a clip keeps its index: same clip as without exclude
    assert torch.equal(skipped.samples.latents[0], plain.samples.latents[first])


def test_a_fixed_set_of_clips_repeats_by_index():
    from sparsevid_lab.data.sources import ProceduralSource

    data = ProceduralVideos(frames=2, height=8, width=8, max_objects=1, backgrounds=["gray"])
    fixed, fresh = ProceduralSource(data, seed=5, clips=3), ProceduralSource(data, seed=5)
    videos, captions = fixed.clips([0, 1, 2, 3, 4, 5])
    assert torch.equal(videos[:3], videos[3:]) and captions[:3] == captions[3:]
    assert torch.equal(videos[:3], fresh.clips([0, 1, 2])[0]) and fixed.describe()["clips"] == 3
    assert not torch.equal(fresh.clips([3])[0], videos[:1])
    with pytest.raises(ValueError, match="clips must be None or a positive int"):
        ProceduralSource(data, clips=0)
