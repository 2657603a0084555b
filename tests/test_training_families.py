"""Fine-tuning of the families whose transformers take more than latents and text: each trains through the one generic
path (``distill``) on latent folders carrying what its pipeline passes (conditioning channels, image embeddings,
history latents, per-call indices), and the saved student reloads; families the path cannot serve are refused."""
from dataclasses import dataclass, field, replace

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import sparsevid as sv  # noqa: E402
from sparsevid.eval import heldout_set, predict_velocities, velocity_error  # noqa: E402
from sparsevid.integration.adapters import FRAMEPACK_INDICES, adapter_for  # noqa: E402
from sparsevid.training import (DistillConfig, LatentBatch, LatentDirectory, LoopConfig, distill,  # noqa: E402
                                load_student, predict_velocity, write_latent_sample, write_null_text)
from sparsevid.training.inputs import CONDITION  # noqa: E402

from tiny_models import build, relative_error  # noqa: E402

SPARSE = sv.SparseConfig(rule="topk", topk=2, block_q=64, block_k=64, tile="none")


@dataclass(frozen=True)
class Case:
    """A tiny family's training data: ``config`` overrides of its tiny model, ``extras`` the inputs of the tiny model
    each sample carries (its row of a batched input; a per-call input as it is), ``prompt_extras`` those that come
    from the prompt (the empty prompt has its own, which caption dropout substitutes), ``fixed`` further inputs."""

    config: dict = field(default_factory=dict)
    extras: tuple[str, ...] = ()
    prompt_extras: tuple[str, ...] = ()
    fixed: dict = field(default_factory=dict)


CASES = {
    "wan_vace": Case(extras=("control_hidden_states",)),
    "wan_animate": Case(extras=("encoder_hidden_states_image", "pose_hidden_states", "face_pixel_values")),
    "hunyuan_video15": Case({"in_channels": 9}, extras=("image_embeds",),
                            prompt_extras=("encoder_hidden_states_2", "encoder_attention_mask_2")),
    "hunyuan_video_framepack": Case(extras=("guidance", "image_embeds", "latents_clean", "latents_history_2x",
                                            "latents_history_4x", *FRAMEPACK_INDICES),
                                    prompt_extras=("pooled_projections",)),
    "motif_video": Case({"in_channels": 9}),
    "easyanimate": Case(),
    "kandinsky5": Case(prompt_extras=("pooled_projections",), fixed={"scale_factor": torch.tensor([1.0, 2.0, 2.0])}),
    "kandinsky6": Case({"visual_cond": True}, prompt_extras=("pooled_projections",)),
}


def _family_data(name: str, tmp_path, count: int = 4):
    """(tiny model, a folder of ``count`` random samples fitting it, as CASES[name] says)."""
    case = CASES[name]
    model, inputs = build(name, **case.config)
    adapter = adapter_for(model)
    grid = adapter.grid(inputs["hidden_states"], model.config)
    latent_shape = (adapter.channels(model.config)[0],
                    *(n * p for n, p in zip(grid, adapter.patch_sizes(model.config))))
    condition_channels = 0 if adapter.zero_condition else adapter.channels(model.config)[1]  # the data's to carry
    text, mask = inputs["encoder_hidden_states"], inputs.get("encoder_attention_mask")
    generator = torch.Generator().manual_seed(1)
    folder = tmp_path / f"latents_{name}"
    per_call = {*adapter.call_inputs, *adapter.call_tensors}
    for i in range(count):
        extra = {key: inputs[key] if key in per_call else inputs[key][i % text.shape[0]]
                 for key in (*case.extras, *case.prompt_extras)}
        extra.update(case.fixed)
        if condition_channels:
            extra[CONDITION] = torch.randn(condition_channels, *latent_shape[1:], generator=generator)
        # latents with a mean, as real ones have: something the flow-matching loss can learn from random samples
        write_latent_sample(folder, i, 1.0 + torch.randn(*latent_shape, generator=generator),
                            torch.randn(*text.shape[1:], generator=generator),
                            None if mask is None else mask[i % mask.shape[0]], extra)
    null_mask = None if mask is None else torch.arange(mask.shape[1]) < 1  # the empty prompt: one token
    null_extra = {key: torch.zeros_like(inputs[key][0]) for key in case.prompt_extras}
    if "encoder_attention_mask_2" in null_extra:
        null_extra["encoder_attention_mask_2"][0] = 1
    write_null_text(folder, torch.zeros(*text.shape[1:]), None if null_mask is None else null_mask.to(mask.dtype),
                    null_extra)
    return model, LatentDirectory(folder, seed=0)


@pytest.mark.parametrize("objective, trainable", [("distill", "attention"), ("diffusion", "lora")])
@pytest.mark.parametrize("name", list(CASES))
def test_family_fine_tunes_and_its_student_loads_back(tmp_path, name, objective, trainable):
    """Fine-tuning lowers the loss (and, distilling, the student's velocity error against the dense teacher); the
    saved student, loaded onto a fresh base, gives the trained student's velocity (its tensors as the student file
    stores them, in bf16)."""
    if trainable == "lora":
        pytest.importorskip("peft")
    torch.manual_seed(0)
    model, data = _family_data(name, tmp_path)
    heldout = heldout_set(data, per_bin=2, num_bins=2)
    dense = predict_velocities(model, heldout)
    before = velocity_error(predict_velocities(model, heldout, SPARSE), dense, heldout)["overall"]
    config = DistillConfig(objective=objective, sparse=SPARSE, trainable=trainable, lora_rank=4, lora_alpha=8.0,
                           batch_size=2, null_prob=0.2)
    lr = 1e-2 if trainable == "lora" else 5e-4  # a LoRA's B starts at zero: it moves with the larger rate
    loop = LoopConfig(lr=lr, warmup_steps=2, ema_decay=None, max_steps=40, log_every=20, bf16=False)
    result = distill(model, data, config, loop, out=tmp_path / "student", log=lambda *_: None)
    early, late = (row["loss"] for row in result.history[-2:])  # the mean losses of steps 2-20 and 21-40
    assert late < early
    if objective == "distill":
        assert velocity_error(predict_velocities(model, heldout), dense, heldout)["overall"] < before
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.copy_(parameter.bfloat16())
    trained = predict_velocities(model, heldout)
    fresh, _ = build(name, **CASES[name].config)
    assert load_student(fresh, tmp_path / "student") == SPARSE and sv.is_sparse(fresh)
    # float32 rounding apart (a LoRA student is merged into its base on loading: W + s B A instead of W x + s B A x)
    assert relative_error(predict_velocities(fresh, heldout), trained) < 1e-5


def _pipeline_call(name, model, x, t, batch):
    """The velocity [B, C, T, H, W] of ``model`` called at latents ``x`` as the family's pipeline calls it."""
    b, _, frames, height, width = x.shape
    extra = dict(batch.extra)
    condition = extra.pop(CONDITION, torch.zeros(b, adapter_for(model).channels(model.config)[1], frames, height,
                                                 width))  # the text-to-video pipeline's zeros
    text, mask, timestep = batch.text, batch.text_mask, 1000 * t
    if name == "kandinsky5":  # channels last; RoPE positions of the patched grid and of the longest prompt
        length = int(mask.sum(1).max())
        out = model(hidden_states=x.permute(0, 2, 3, 4, 1), encoder_hidden_states=text[:, :length],
                    pooled_projections=extra["pooled_projections"], timestep=timestep,
                    visual_rope_pos=[torch.arange(frames), torch.arange(height // 2), torch.arange(width // 2)],
                    text_rope_pos=torch.arange(length), scale_factor=(1.0, 2.0, 2.0)).sample
        return out.permute(0, 4, 1, 2, 3)
    if name == "kandinsky6":  # channels last, then the conditioning latents and mask on the last dim
        hidden = torch.cat([x.permute(0, 2, 3, 4, 1), condition.permute(0, 2, 3, 4, 1)], dim=-1)
        out = model(hidden_states=hidden, encoder_hidden_states=text, pooled_projections=extra["pooled_projections"],
                    timestep=timestep, encoder_attention_mask=mask).sample
        return out.permute(0, 4, 1, 2, 3)
    if name == "easyanimate":  # no text mask
        return model(x, timestep, encoder_hidden_states=text).sample
    extra.update({key: extra[key][0] for key in FRAMEPACK_INDICES if key in extra})  # one set of indices per call
    return model(hidden_states=torch.cat([x, condition], dim=1), timestep=timestep, encoder_hidden_states=text,
                 **({} if mask is None else {"encoder_attention_mask": mask}), **extra).sample


@pytest.mark.parametrize("name", ["kandinsky5", "kandinsky6", "easyanimate", "wan_animate", "hunyuan_video15",
                                  "hunyuan_video_framepack"])
def test_predict_velocity_calls_the_transformer_as_its_pipeline_does(tmp_path, name):
    """Channels-last latents, conditioning channels (the data's, or the text-to-video pipeline's zeros), RoPE
    positions, per-call indices, a text mask the transformer does not take: predict_velocity on 5D latents
    [B, C, T, H, W] equals the call the family's pipeline makes."""
    model, data = _family_data(name, tmp_path)
    batch = data.batch([0, 1])
    if not adapter_for(model).text_mask:  # padding the transformer cannot be told about
        mask = torch.ones(batch.text.shape[:2], dtype=torch.bool)
        mask[0, 7:], mask[1, 9:] = False, False
        batch = LatentBatch(batch.latents, batch.text, mask, batch.extra)
    x, t = batch.latents, torch.tensor([0.3, 0.8])
    with torch.no_grad():
        assert torch.equal(predict_velocity(model, x, t, batch), _pipeline_call(name, model, x, t, batch))


def test_training_refuses_ltx2_and_names_what_the_data_lack(tmp_path):
    """LTX-2 (audio and video denoised together) is refused with the reason; a batch lacking what a family's forward
    needs, or carrying what it cannot take, is a ValueError naming it."""
    vace, data = _family_data("wan_vace", tmp_path)
    loop = LoopConfig(max_steps=1, ema_decay=None, bf16=False)
    with pytest.raises(TypeError, match="LTX2VideoTransformer3DModel cannot be fine-tuned.*audio and video"):
        distill(build("ltx2")[0], data, DistillConfig(sparse=SPARSE, batch_size=2), loop, log=lambda *_: None)
    t = torch.tensor([0.3, 0.8])

    def call(model, batch):
        return predict_velocity(model, batch.latents, t, batch)

    batch = data.batch([0, 1])
    with pytest.raises(ValueError, match="without control_hidden_states.*extra.control_hidden_states"):
        call(vace, replace(batch, extra={}))
    with pytest.raises(ValueError, match="takes no conditioning channels"):
        call(vace, replace(batch, extra={**batch.extra, CONDITION: torch.zeros(2, 1, 4, 16, 20)}))
    animate, data = _family_data("wan_animate", tmp_path)
    batch = data.batch([0, 1])
    with pytest.raises(ValueError, match=f"takes 8 conditioning channels.*extra.{CONDITION}"):
        call(animate, replace(batch, extra={k: v for k, v in batch.extra.items() if k != CONDITION}))
    with pytest.raises(ValueError, match=f"extra.{CONDITION} has shape"):
        call(animate, replace(batch, extra={**batch.extra, CONDITION: batch.extra[CONDITION][:, :4]}))
    framepack, data = _family_data("hunyuan_video_framepack", tmp_path)
    batch = data.batch([0, 1])
    with pytest.raises(ValueError, match="without encoder_attention_mask: .*\\(text_mask\\)"):
        call(framepack, replace(batch, text_mask=None))
    shifted = batch.extra["indices_latents"] + torch.tensor([[0.0], [1.0]])
    with pytest.raises(ValueError, match="'indices_latents'.* differs between the batch's samples"):
        call(framepack, replace(batch, extra={**batch.extra, "indices_latents": shifted}))
    kandinsky, data = _family_data("kandinsky5", tmp_path)
    batch = data.batch([0, 1])
    left_padded = torch.ones(batch.text.shape[:2], dtype=torch.bool)
    left_padded[0, :3] = False
    with pytest.raises(ValueError, match="text_mask must mark each prompt's tokens first"):
        call(kandinsky, replace(batch, text_mask=left_padded))
