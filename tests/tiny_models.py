"""Tiny diffusers video transformers built from configs, with inputs, for the integration tests (float32, CPU).

Import after ``pytest.importorskip("diffusers")``.
"""
import diffusers
import torch


def wan(**config):
    """WanTransformer3DModel on a 4 x 8 x 10 token grid (320 tokens); ``config`` overrides the model config."""
    model = diffusers.WanTransformer3DModel(**{
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
        "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32, "num_layers": 3, "cross_attn_norm": True,
        "rope_max_seq_len": 32, **config})
    inputs = {"hidden_states": torch.randn(1, 4, 4, 16, 20), "timestep": torch.tensor([700]),
              "encoder_hidden_states": torch.randn(1, 12, 16)}
    return model, inputs


def hunyuan_video(**config):
    """HunyuanVideoTransformer3DModel on a 3 x 10 x 10 grid, batch 2 with different text padding."""
    model = diffusers.HunyuanVideoTransformer3DModel(**{
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10, "num_layers": 2,
        "num_single_layers": 2, "num_refiner_layers": 1, "patch_size": 1, "patch_size_t": 1,
        "guidance_embeds": True, "text_embed_dim": 16, "pooled_projection_dim": 8, "rope_axes_dim": (2, 4, 4),
        **config})
    text_mask = torch.ones(2, 12, dtype=torch.long)
    text_mask[0, 7:] = 0  # different padding per batch entry
    text_mask[1, 10:] = 0
    inputs = {"hidden_states": torch.randn(2, 4, 3, 10, 10), "timestep": torch.tensor([700, 700]),
              "encoder_hidden_states": torch.randn(2, 12, 16), "encoder_attention_mask": text_mask,
              "pooled_projections": torch.randn(2, 8), "guidance": torch.tensor([3000.0, 3000.0])}
    return model, inputs


def cogvideox(**config):
    """CogVideoXTransformer3DModel (RoPE given as an argument) on a 4 x 8 x 10 grid after 2x2 patching."""
    model = diffusers.CogVideoXTransformer3DModel(**{
        "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "out_channels": 4, "time_embed_dim": 2,
        "text_embed_dim": 8, "num_layers": 2, "sample_width": 20, "sample_height": 16, "sample_frames": 13,
        "patch_size": 2, "temporal_compression_ratio": 4, "max_text_seq_length": 8,
        "use_rotary_positional_embeddings": True, **config})
    frames, height, width = 4, 8, 10  # latent grid after 2x2 patching
    angles = torch.randn(frames * height * width, 4).repeat_interleave(2, dim=-1)  # [N, head_dim]
    inputs = {"hidden_states": torch.randn(1, frames, 4, 2 * height, 2 * width), "timestep": torch.tensor([700]),
              "encoder_hidden_states": torch.randn(1, 8, 8), "image_rotary_emb": (angles.cos(), angles.sin())}
    return model, inputs


def chronoedit(**config):
    """ChronoEditTransformer3DModel (Wan's layout, RoPE skipping frames in time) on Wan's 4 x 8 x 10 grid."""
    model = diffusers.ChronoEditTransformer3DModel(**{
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
        "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32, "num_layers": 3, "cross_attn_norm": True,
        "rope_max_seq_len": 32, "rope_temporal_skip_len": 2, **config})
    _, inputs = wan()
    return model, inputs


def wan_vace(**config):
    """WanVACETransformer3DModel on Wan's 4 x 8 x 10 grid with a control video of the same grid (8 channels) and
    VACE hints added after blocks 0 and 2."""
    model = diffusers.WanVACETransformer3DModel(**{
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
        "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32, "num_layers": 3, "cross_attn_norm": True,
        "rope_max_seq_len": 32, "vace_layers": [0, 2], "vace_in_channels": 8, **config})
    _, inputs = wan()
    return model, {**inputs, "control_hidden_states": torch.randn(1, 8, 4, 16, 20),
                   "control_hidden_states_scale": torch.tensor([1.0, 0.5])}


def skyreels_v2(**config):
    """SkyReelsV2Transformer3DModel on Wan's 4 x 8 x 10 grid."""
    model = diffusers.SkyReelsV2Transformer3DModel(**{
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
        "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32, "num_layers": 3, "cross_attn_norm": True,
        "rope_max_seq_len": 32, **config})
    _, inputs = wan()
    return model, inputs


def wan22_ti2v(**config):
    """Wan2.2 TI2V-5B's layout (48 latent channels) on Wan's 4 x 8 x 10 grid, batch 2, with its per-token timestep
    [B, N]: the conditioning first frame at timestep 0, the rest at the step's timestep."""
    model, _ = wan(in_channels=48, out_channels=48, **config)
    grid = 4 * 8 * 10
    timestep = torch.full((2, grid), 700.0)
    timestep[:, :8 * 10] = 0.0  # the first latent frame is the clean image
    inputs = {"hidden_states": torch.randn(2, 48, 4, 16, 20), "timestep": timestep,
              "encoder_hidden_states": torch.randn(2, 12, 16)}
    return model, inputs


def ltx(**config):
    """LTXVideoTransformer3DModel on a 4 x 8 x 10 grid of patched tokens [B, N, C], batch 2 with different text
    padding and an image-to-video per-token timestep [B, N] (first frame clean)."""
    model = diffusers.LTXVideoTransformer3DModel(**{
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 12,
        "cross_attention_dim": 24, "num_layers": 3, "caption_channels": 16, **config})
    frames, height, width = 4, 8, 10
    timestep = torch.full((2, frames * height * width), 700.0)
    timestep[:, :height * width] = 0.0
    text_mask = torch.ones(2, 12, dtype=torch.long)
    text_mask[1, 9:] = 0
    inputs = {"hidden_states": torch.randn(2, frames * height * width, 4), "timestep": timestep,
              "encoder_hidden_states": torch.randn(2, 12, 16), "encoder_attention_mask": text_mask,
              "num_frames": frames, "height": height, "width": width, "rope_interpolation_scale": (0.4, 32.0, 32.0)}
    return model, inputs


def hunyuan_video15(**config):
    """HunyuanVideo15Transformer3DModel on a 3 x 10 x 10 grid, batch 2 with different padding of both texts
    (text-to-video: zero image embeddings)."""
    model = diffusers.HunyuanVideo15Transformer3DModel(**{
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10, "num_layers": 3,
        "num_refiner_layers": 1, "text_embed_dim": 16, "text_embed_2_dim": 8, "image_embed_dim": 12,
        "rope_axes_dim": (2, 4, 4), **config})
    text_mask, text_mask_2 = torch.ones(2, 12, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
    text_mask[0, 7:] = 0
    text_mask_2[1, 4:] = 0
    inputs = {"hidden_states": torch.randn(2, 4, 3, 10, 10), "timestep": torch.tensor([700.0, 700.0]),
              "encoder_hidden_states": torch.randn(2, 12, 16), "encoder_attention_mask": text_mask,
              "encoder_hidden_states_2": torch.randn(2, 6, 8), "encoder_attention_mask_2": text_mask_2,
              "image_embeds": torch.zeros(2, 5, 12)}
    return model, inputs


def wan_animate(**config):
    """WanAnimateTransformer3DModel on Wan's 4 x 8 x 10 grid (noisy + reference latents and mask, 12 channels), pose
    latents for frames 1..3, a 9-frame face video and face adapters after blocks 0 and 2."""
    model = diffusers.WanAnimateTransformer3DModel(**{
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 12,
        "latent_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32, "num_layers": 4,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "image_dim": 16, "rope_max_seq_len": 32,
        "motion_encoder_channel_sizes": {"4": 16, "8": 16, "16": 16}, "motion_encoder_size": 16,
        "motion_style_dim": 8, "motion_dim": 4, "motion_encoder_dim": 16, "face_encoder_hidden_dim": 16,
        "face_encoder_num_heads": 2, "inject_face_latents_blocks": 2, **config})
    inputs = {"hidden_states": torch.randn(1, 12, 4, 16, 20), "timestep": torch.tensor([700]),
              "encoder_hidden_states": torch.randn(1, 12, 16), "encoder_hidden_states_image": torch.randn(1, 4, 16),
              "pose_hidden_states": torch.randn(1, 4, 3, 16, 20), "face_pixel_values": torch.randn(1, 3, 9, 16, 16)}
    return model, inputs


def consisid(**config):
    """ConsisIDTransformer3DModel (CogVideoX's layout) on CogVideoX's 4 x 8 x 10 grid, with its identity
    cross-attention (face embeddings) after every block."""
    model = diffusers.ConsisIDTransformer3DModel(**{
        "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "out_channels": 4, "time_embed_dim": 2,
        "text_embed_dim": 8, "num_layers": 3, "sample_width": 20, "sample_height": 16, "sample_frames": 13,
        "patch_size": 2, "temporal_compression_ratio": 4, "max_text_seq_length": 8,
        "use_rotary_positional_embeddings": True, "cross_attn_interval": 1, "is_kps": False, "is_train_face": True,
        "cross_attn_dim_head": 4, "cross_attn_num_heads": 2, "LFE_id_dim": 2, "LFE_vit_dim": 2, "LFE_depth": 5,
        "LFE_dim_head": 8, "LFE_num_heads": 2, "LFE_num_id_token": 1, "LFE_num_querie": 1, "LFE_output_dim": 10,
        "LFE_ff_mult": 1, "LFE_num_scale": 1, **config})
    _, inputs = cogvideox()
    return model, {**inputs, "id_vit_hidden": [torch.randn(1, 2, 2)], "id_cond": torch.randn(1, 2)}


def easyanimate(**config):
    """EasyAnimateTransformer3DModel on a 4 x 8 x 10 grid after 2x2 patching: two MMDiT blocks (text projections of
    their own) and one shared-projection block."""
    model = diffusers.EasyAnimateTransformer3DModel(**{
        "attention_head_dim": 16, "num_attention_heads": 2, "in_channels": 4, "out_channels": 4, "mmdit_layers": 2,
        "num_layers": 3, "patch_size": 2, "text_embed_dim": 16, "time_embed_dim": 8, **config})
    inputs = {"hidden_states": torch.randn(1, 4, 4, 16, 20), "timestep": torch.tensor([700]),
              "encoder_hidden_states": torch.randn(1, 12, 16)}
    return model, inputs


def cosmos(**config):
    """CosmosTransformer3DModel on a 4 x 8 x 10 grid after 1x2x2 patching, with a learnable position embedding and a
    video-to-world per-frame timestep [B, 1, T, 1, 1] (first frame clean; no padding-mask channel: that needs
    torchvision)."""
    model = diffusers.CosmosTransformer3DModel(**{
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 12, "num_layers": 3,
        "mlp_ratio": 2, "text_embed_dim": 16, "adaln_lora_dim": 4, "max_size": (4, 32, 32), "patch_size": (1, 2, 2),
        "rope_scale": (2.0, 1.0, 1.0), "concat_padding_mask": False, "extra_pos_embed_type": "learnable", **config})
    timestep = torch.full((1, 1, 4, 1, 1), 0.7)
    timestep[:, :, 0] = 0.0
    inputs = {"hidden_states": torch.randn(1, 4, 4, 16, 20), "timestep": timestep,
              "encoder_hidden_states": torch.randn(1, 12, 16), "fps": 24}
    return model, inputs


def motif_video(**config):
    """MotifVideoTransformer3DModel on a 3 x 10 x 10 grid, batch 2 with different text padding: one dual-stream block,
    one single-stream block and one decoder layer."""
    model = diffusers.MotifVideoTransformer3DModel(**{
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 12, "num_layers": 1,
        "num_single_layers": 2, "num_decoder_layers": 1, "patch_size": 1, "patch_size_t": 1, "text_embed_dim": 16,
        "image_embed_dim": 4, "rope_axes_dim": (4, 4, 4), "enable_text_cross_attention_dual": False,
        "enable_text_cross_attention_single": False, **config})
    text_mask = torch.ones(2, 12, dtype=torch.long)
    text_mask[0, 7:] = 0
    inputs = {"hidden_states": torch.randn(2, 4, 3, 10, 10), "timestep": torch.tensor([700, 700]),
              "encoder_hidden_states": torch.randn(2, 12, 16), "encoder_attention_mask": text_mask}
    return model, inputs


def kandinsky5(**config):
    """Kandinsky5Transformer3DModel on a 4 x 8 x 10 grid after 1x2x2 patching of channels-last latents
    [B, T, H, W, C], batch 2; its modulations (zero at initialisation, which would gate every block off) drawn."""
    model = diffusers.Kandinsky5Transformer3DModel(**{
        "in_visual_dim": 4, "out_visual_dim": 4, "in_text_dim": 16, "in_text_dim2": 8, "time_dim": 16,
        "patch_size": (1, 2, 2), "model_dim": 24, "ff_dim": 32, "num_text_blocks": 1, "num_visual_blocks": 3,
        "axes_dims": (4, 4, 4), "visual_cond": False, "attention_type": "regular", **config})
    for name, parameter in model.named_parameters():
        if "modulation.out_layer" in name:
            torch.nn.init.normal_(parameter, std=0.2)
    frames, height, width = 4, 8, 10
    inputs = {"hidden_states": torch.randn(2, frames, 2 * height, 2 * width, 4),
              "encoder_hidden_states": torch.randn(2, 12, 16), "pooled_projections": torch.randn(2, 8),
              "timestep": torch.tensor([700.0, 700.0]),
              "visual_rope_pos": [torch.arange(frames), torch.arange(height), torch.arange(width)],
              "text_rope_pos": torch.arange(12)}
    return model, inputs


def allegro(**config):
    """AllegroTransformer3DModel on a 4 x 8 x 10 grid after 2x2 patching, with the RoPE its pipeline passes."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    model = diffusers.AllegroTransformer3DModel(**{
        "num_attention_heads": 2, "attention_head_dim": 24, "in_channels": 4, "out_channels": 4, "num_layers": 3,
        "cross_attention_dim": 48, "sample_width": 20, "sample_height": 16, "sample_frames": 4,
        "caption_channels": 8, **config})
    frames, height, width = 4, 8, 10
    *freqs, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=24, crops_coords=((0, 0), (height, width)), grid_size=(height, width), temporal_size=frames,
        interpolation_scale=(2.0, 2.0, 2.0))
    positions = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long()).T.reshape(3, 1, -1)
    inputs = {"hidden_states": torch.randn(1, 4, frames, 2 * height, 2 * width), "timestep": torch.tensor([700]),
              "encoder_hidden_states": torch.randn(1, 12, 8), "image_rotary_emb": (tuple(freqs), tuple(positions))}
    return model, inputs


def ltx2(**config):
    """LTX2VideoTransformer3DModel (audio and video) on a 4 x 8 x 10 grid of video tokens [B, N, C] and 9 audio
    frames, batch 2 with different text padding and a per-token video timestep [B, N] (first frame clean)."""
    model = diffusers.LTX2VideoTransformer3DModel(**{
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
        "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4, "audio_num_attention_heads": 2,
        "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8, "num_layers": 3,
        "qk_norm": "rms_norm_across_heads", "caption_channels": 16, "rope_double_precision": False, **config})
    frames, height, width = 4, 8, 10
    timestep = torch.full((2, frames * height * width), 700.0)
    timestep[:, :height * width] = 0.0
    text_mask = torch.ones(2, 12, dtype=torch.bool)
    text_mask[1, 9:] = False
    inputs = {"hidden_states": torch.randn(2, frames * height * width, 4), "audio_hidden_states": torch.randn(2, 9, 4),
              "encoder_hidden_states": torch.randn(2, 12, 16), "audio_encoder_hidden_states": torch.randn(2, 12, 16),
              "timestep": timestep, "audio_timestep": torch.tensor([700.0, 700.0]),
              "encoder_attention_mask": text_mask, "num_frames": frames, "height": height, "width": width,
              "audio_num_frames": 9, "fps": 25.0}
    return model, inputs


def kandinsky6(**config):
    """Kandinsky6Transformer3DModel (video and audio) on a 4 x 8 x 10 grid after 1x2x2 patching of channels-last
    latents [B, T, H, W, C] and 6 audio frames, batch 2 with different text padding; modulations drawn (zero at
    initialisation)."""
    model = diffusers.Kandinsky6Transformer3DModel(**{
        "in_visual_dim": 4, "out_visual_dim": 4, "in_text_dim": 16, "in_text_dim2": 8, "time_dim": 16,
        "patch_size": (1, 2, 2), "model_dim": 24, "ff_dim": 32, "num_text_blocks": 1, "num_visual_blocks": 3,
        "axes_dims": (4, 4, 4), "visual_cond": False, "in_audio_dim": 4, "out_audio_dim": 4, **config})
    for name, parameter in model.named_parameters():
        if "modulation.out_layer" in name:
            torch.nn.init.normal_(parameter, std=0.2)
    text_mask = torch.ones(2, 12, dtype=torch.bool)
    text_mask[1, 8:] = False
    inputs = {"hidden_states": torch.randn(2, 4, 16, 20, 4), "encoder_hidden_states": torch.randn(2, 12, 16),
              "pooled_projections": torch.randn(2, 8), "timestep": torch.tensor([700.0, 700.0]),
              "audio_hidden_states": torch.randn(2, 6, 4), "encoder_attention_mask": text_mask}
    return model, inputs


def hunyuan_video_framepack(**config):
    """HunyuanVideoFramepackTransformer3DModel on a 3 x 8 x 12 grid after 2x2 patching, with 228 history tokens (two
    clean frames, two frames at 2x and eight at 4x) before the video, batch 2 with different text padding."""
    model = diffusers.HunyuanVideoFramepackTransformer3DModel(**{
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10, "num_layers": 2,
        "num_single_layers": 2, "num_refiner_layers": 1, "patch_size": 2, "patch_size_t": 1, "guidance_embeds": True,
        "text_embed_dim": 16, "pooled_projection_dim": 8, "rope_axes_dim": (2, 4, 4), "image_condition_type": None,
        "has_image_proj": True, "image_proj_dim": 16, "has_clean_x_embedder": True, **config})
    text_mask = torch.ones(2, 12, dtype=torch.long)
    text_mask[1, 8:] = 0
    latents = {"latents_clean": 2, "latents_history_2x": 2, "latents_history_4x": 8}
    inputs = {"hidden_states": torch.randn(2, 4, 3, 16, 24), "timestep": torch.tensor([700, 700]),
              "encoder_hidden_states": torch.randn(2, 12, 16), "encoder_attention_mask": text_mask,
              "pooled_projections": torch.randn(2, 8), "guidance": torch.tensor([3000.0, 3000.0]),
              "image_embeds": torch.randn(2, 4, 16), "indices_latents": torch.arange(3.0) + 10,
              **{name: torch.randn(2, 4, frames, 16, 24) for name, frames in latents.items()},
              **{"indices_" + name: torch.arange(float(frames)) for name, frames in latents.items()}}
    return model, inputs


def mochi(**config):
    """MochiTransformer3DModel on a 4 x 8 x 10 grid after 2x2 patching, batch 2 with different text padding; its RoPE
    frequencies (zero at initialisation, which would make RoPE the identity) drawn."""
    model = diffusers.MochiTransformer3DModel(**{
        "patch_size": 2, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 3,
        "pooled_projection_dim": 16, "in_channels": 4, "text_embed_dim": 16, "time_embed_dim": 4,
        "max_sequence_length": 16, **config})
    torch.nn.init.normal_(model.pos_frequencies, std=0.5)
    text_mask = torch.ones(2, 12, dtype=torch.bool)
    text_mask[0, 7:] = False
    text_mask[1, 10:] = False
    inputs = {"hidden_states": torch.randn(2, 4, 4, 16, 20), "timestep": torch.tensor([300, 300]),
              "encoder_hidden_states": torch.randn(2, 12, 16), "encoder_attention_mask": text_mask}
    return model, inputs


MODELS = {"wan": wan, "wan22_ti2v": wan22_ti2v, "hunyuan_video": hunyuan_video, "cogvideox": cogvideox,
          "chronoedit": chronoedit, "wan_vace": wan_vace, "skyreels_v2": skyreels_v2, "ltx": ltx,
          "hunyuan_video15": hunyuan_video15, "wan_animate": wan_animate, "consisid": consisid,
          "easyanimate": easyanimate, "cosmos": cosmos, "motif_video": motif_video, "kandinsky5": kandinsky5,
          "allegro": allegro, "ltx2": ltx2, "kandinsky6": kandinsky6,
          "hunyuan_video_framepack": hunyuan_video_framepack, "mochi": mochi}
VIDEO_TOKENS = {"wan": 4 * 8 * 10, "wan22_ti2v": 4 * 8 * 10, "hunyuan_video": 3 * 10 * 10, "cogvideox": 4 * 8 * 10,
                "chronoedit": 4 * 8 * 10, "wan_vace": 4 * 8 * 10, "skyreels_v2": 4 * 8 * 10, "ltx": 4 * 8 * 10,
                "hunyuan_video15": 3 * 10 * 10, "wan_animate": 4 * 8 * 10, "consisid": 4 * 8 * 10,
                "easyanimate": 4 * 8 * 10, "cosmos": 4 * 8 * 10, "motif_video": 3 * 10 * 10, "kandinsky5": 4 * 8 * 10,
                "allegro": 4 * 8 * 10, "ltx2": 4 * 8 * 10, "kandinsky6": 4 * 8 * 10,
                "hunyuan_video_framepack": 228 + 3 * 8 * 12, "mochi": 4 * 8 * 10}


def build(name, **config):
    """(model in eval mode, inputs) of the tiny ``name`` model, seeded."""
    torch.manual_seed(0)
    model, inputs = MODELS[name](**config)
    return model.eval(), inputs


@torch.no_grad()
def run_model(model, inputs):
    """The output tensor of ``model(**inputs)`` (no gradient)."""
    return model(**inputs, return_dict=False)[0]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm())
