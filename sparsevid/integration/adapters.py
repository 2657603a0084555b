"""What the integration needs to know about each supported diffusers video transformer.

An adapter names the transformer's video self-attention modules (in layer order), reads the latent
token grid from the forward inputs, says where text tokens sit in a joint attention sequence, and names
the position-wise tensors that must follow the video token order when a whole forward runs in 3D-tile
order (see ``token_order``). Everything else (projections, norms, RoPE, the attention call itself) stays
diffusers' own code.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class TokenSite:
    """A position-wise tensor whose video tokens must follow the forward's token order.

    Attributes:
        name: a submodule path (its output, a tensor or a tuple of tensors, is reordered) or, with
            ``argument=True``, a forward argument of the transformer.
        dim: the token dim; the video tokens are the last ``T*H*W`` entries along it (text may precede them).
        argument: ``name`` is a forward argument, reordered by a forward pre-hook.
        min_dims: tensors with fewer dims are left alone (e.g. a per-sample timestep [B] versus a per-token
            timestep [B, N]).
        channels_first: the output is a 5D patch embedding [B, C, T, H, W] (tokens are dims 2..4).
        frames_in_batch: the output is a per-frame patch embedding [B*T, H*W, C] (frames folded into the batch; the
            model then flattens it to [B, T*H*W, C]).
    """

    name: str
    dim: int = 1
    argument: bool = False
    min_dims: int = 0
    channels_first: bool = False
    frames_in_batch: bool = False


def _always(config) -> bool:
    return True


FLOW_TIMESTEPS = 1000.0  # diffusers' flow-matching schedulers pass timestep = 1000 t at noise level t


def _in_out_channels(config) -> tuple[int, int]:
    """(latent channels, conditioning channels): the input channels beyond the predicted ones are conditioning."""
    predicts = getattr(config, "out_channels", None) or config.in_channels
    return predicts, config.in_channels - predicts


@dataclass(frozen=True)
class ModelAdapter:
    """Model-family facts.

    Attributes:
        name: family name used in messages.
        class_name: the diffusers transformer class it handles.
        block_attrs: ((ModuleList attribute, attention submodule path in a block), ...) of the self-attentions, in
            order.
        frames_dim: dim of ``hidden_states`` (the 5D latent input) that holds frames; H, W are the last two.
        text_first: in joint attention, text tokens precede the video tokens (else they follow).
        patch_sizes: (t, h, w) patch size from the model config.
        token_sites: every input of the blocks that depends on video token positions (patch embedding,
            RoPE tables, per-token conditioning).
        output_module: the position-wise submodule after the blocks whose output [B, N, C] (video tokens
            only) is put back in raster order before unpatchifying.
        reorders_forward: whether ``token_sites`` cover a model with this config (else every sparse layer
            reorders its own q, k, v).
        objective: what the family's pre-training predicts: "flow" (the rectified-flow velocity noise - x0 at
            x_t = (1 - t) x0 + t noise, timestep 1000 t) or "v_prediction" (DDPM); sparsevid's training path
            fine-tunes flow families.
        inverted_time: a flow family whose transformer takes timestep 1000 (1 - t) and predicts x0 - noise (Mochi,
            whose scheduler inverts the sigmas): its timesteps rise over the denoising (see :meth:`flow_timestep`).
        latents: the family whose VAE and text encoder make this transformer's inputs (None: its own ``name``);
            cached training data record it, and data of another family are refused.
        grid_arguments: for transformers that take patched tokens [B, N, C] (LTX), the forward arguments that give
            the latent frames, height and width (divided by ``patch_sizes`` for the token grid); None: the grid comes
            from the 5D ``hidden_states``.
        spatial_dims: the dims of the 5D ``hidden_states`` that hold height and width ((2, 3) for channels-last
            latents [B, T, H, W, C]).
        call_inputs: the forward arguments that take one tuple of numbers per call (LTX's ``rope_interpolation_scale``)
            where training data store a tensor per sample (see :meth:`latent_inputs` for the latents themselves).
        needs_text_mask: the forward requires ``encoder_attention_mask`` (Mochi): training data without text masks
            pass every text token as valid.
        batch_loop: the attention processor attends each batch entry in a separate call over that entry's video
            and valid text tokens (Mochi); a sparse layer packs the batch into one entry (``packed_batch``).
        call_tensors: likewise, the forward arguments that take one tensor per call (FramePack's frame indices [T]).
        channels: (latent channels, conditioning channels) from the model config: the transformer's input is the
            noisy latents with that many conditioning channels (reference or image latents and their mask)
            concatenated after them, as its pipeline builds it.
        zero_condition: without conditioning latents in the data the conditioning channels are zeros (what the
            family's text-to-video pipeline passes); else the data must carry them.
        required_inputs: the forward arguments a training call cannot do without (beyond latents, timestep and
            text), which the data carry as ``text_mask`` (``encoder_attention_mask``) or ``extra.<name>``.
        text_mask: the transformer takes the text's padding mask (``encoder_attention_mask``); else the data's mask
            is not passed and the text states are attended as they are, padding included (as its pipeline does).
        grid_positions: the forward argument that takes the token grid's positions, one ``arange`` per axis
            (Kandinsky 5's ``visual_rope_pos``).
        text_positions: the forward argument that takes the text tokens' positions (Kandinsky 5's ``text_rope_pos``);
            its pipeline pads a batch's prompts to the longest, so the text is cut to the batch's longest prompt.
        projections: the linear projections of a self-attention module (q, k, v, out) that LoRA adapts.
        training_refused: why sparsevid's training path cannot fine-tune this flow family (None: it can).
    """

    name: str
    class_name: str
    block_attrs: tuple[tuple[str, str], ...]
    frames_dim: int
    text_first: bool
    patch_sizes: Callable[[object], tuple[int, int, int]]
    token_sites: tuple[TokenSite, ...]
    output_module: str = "proj_out"
    reorders_forward: Callable[[object], bool] = _always
    objective: str = "flow"
    latents: str | None = None
    grid_arguments: tuple[str, str, str] | None = None
    spatial_dims: tuple[int, int] = (-2, -1)
    call_inputs: tuple[str, ...] = ()
    inverted_time: bool = False
    needs_text_mask: bool = False
    batch_loop: bool = False

    def flow_timestep(self, timestep):
        """A timestep (tensor, number or None) as this transformer takes it, in the flow convention (1000 t at noise
        level t), and back (the map is its own inverse): ``1000 - timestep`` where ``inverted_time``."""
        if not self.inverted_time or timestep is None:
            return timestep
        return FLOW_TIMESTEPS - timestep
    call_tensors: tuple[str, ...] = ()
    channels: Callable[[object], tuple[int, int]] = _in_out_channels
    zero_condition: bool = False
    required_inputs: tuple[str, ...] = ()
    text_mask: bool = True
    grid_positions: str | None = None
    text_positions: str | None = None
    projections: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    training_refused: str | None = None

    def latent_inputs(self, latents: torch.Tensor, config) -> dict[str, torch.Tensor | int | list]:
        """The forward arguments that carry ``latents`` [B, C, T, H, W] in this transformer's layout: ``hidden_states``
        [B, C, T, H, W], [B, T, C, H, W] (``frames_dim`` 1), [B, T, H, W, C] (channels last: ``spatial_dims`` (2, 3)),
        or patched tokens [B, T' H' W', C p_t p_h p_w] (tokens in raster order, each its channels then its patch in
        raster order) with T, H, W as the ``grid_arguments``, as LTXPipeline calls its transformer (every LTX-Video
        model has patch size 1, where they are the token grid); and the ``grid_positions`` of the patched grid."""
        if self.grid_arguments is None:
            inputs = {"hidden_states": latents.permute(self._layout())}
            if self.grid_positions is not None:
                sizes = (n // p for n, p in zip(latents.shape[2:], self.patch_sizes(config)))
                inputs[self.grid_positions] = [torch.arange(n, device=latents.device) for n in sizes]
            return inputs
        b, c, t, h, w = latents.shape
        p_t, p_h, p_w = self.patch_sizes(config)
        tokens = latents.reshape(b, c, t // p_t, p_t, h // p_h, p_h, w // p_w, p_w).permute(0, 2, 4, 6, 1, 3, 5, 7)
        return {"hidden_states": tokens.reshape(b, t * h * w // (p_t * p_h * p_w), -1),
                **dict(zip(self.grid_arguments, (t, h, w)))}

    def latent_output(self, output: torch.Tensor, shape: torch.Size, config) -> torch.Tensor:
        """The transformer's ``output`` (laid out as :meth:`latent_inputs`'s ``hidden_states``) as latents of
        ``shape`` [B, C, T, H, W]."""
        if self.grid_arguments is None:
            layout = self._layout()
            return output.permute(tuple(layout.index(dim) for dim in range(5)))
        b, c, t, h, w = shape
        p_t, p_h, p_w = self.patch_sizes(config)
        patches = output.reshape(b, t // p_t, h // p_h, w // p_w, c, p_t, p_h, p_w).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return patches.reshape(shape)

    def _layout(self) -> tuple[int, ...]:
        """The dims of latents [B, C, T, H, W] in the order of this transformer's 5D ``hidden_states``."""
        if self.spatial_dims == (2, 3):
            return 0, 2, 3, 4, 1
        return (0, 2, 1, 3, 4) if self.frames_dim == 1 else (0, 1, 2, 3, 4)

    def self_attentions(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        """The video self-attention modules of ``transformer``, in layer order."""
        found = []
        for blocks_attr, attn_attr in self.block_attrs:
            for block in getattr(transformer, blocks_attr):
                found.append(block.get_submodule(attn_attr))
        return found

    def grid(self, hidden_states: torch.Tensor, config) -> tuple[int, int, int] | None:
        """(T, H, W) latent tokens after patching, from the 5D ``hidden_states`` input (None if not 5D)."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 5:
            return None
        p_t, p_h, p_w = self.patch_sizes(config)
        frames, height, width = (hidden_states.shape[dim] for dim in (self.frames_dim, *self.spatial_dims))
        return frames // p_t, height // p_h, width // p_w

    def call_grid(self, transformer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        """(T, H, W) latent tokens of a call ``transformer(*args, **kwargs)`` (None if the call does not say)."""
        if self.grid_arguments is None:
            return self.grid(forward_argument(transformer, "hidden_states", args, kwargs), transformer.config)
        sizes = [forward_argument(transformer, name, args, kwargs) for name in self.grid_arguments]
        if any(size is None for size in sizes):
            return None
        return tuple(int(size) // patch for size, patch in zip(sizes, self.patch_sizes(transformer.config)))


def _wan_patch(config) -> tuple[int, int, int]:
    p_t, p_h, p_w = config.patch_size
    return int(p_t), int(p_h), int(p_w)


def _square_patch(config) -> tuple[int, int, int]:
    p_t = getattr(config, "patch_size_t", None) or 1
    return int(p_t), int(config.patch_size), int(config.patch_size)


def _never(config) -> bool:
    return False


def _no_token_replace(config) -> bool:
    # HunyuanVideo I2V "token_replace" modulates the first frame's tokens by their position in raster order.
    return getattr(config, "image_condition_type", None) != "token_replace"


def _visual_cond_channels(config) -> tuple[int, int]:
    """Kandinsky's (latent, conditioning) channels: with visual_cond, a conditioning latent and its mask channel."""
    return config.in_visual_dim, config.in_visual_dim + 1 if config.visual_cond else 0


KANDINSKY_PROJECTIONS = ("to_query", "to_key", "to_value", "out_layer")

# Wan: RoPE tables [1, N, 1, D]; Wan2.2 TI2V passes a per-token timestep [B, N].
WAN_TOKEN_SITES = (TokenSite("patch_embedding", channels_first=True), TokenSite("rope", dim=1),
                   TokenSite("timestep", dim=1, argument=True, min_dims=2))

FRAMEPACK_INDICES = ("indices_latents", "indices_latents_clean", "indices_latents_history_2x",
                     "indices_latents_history_4x")

# CogVideoX: the patch embedding returns [text, video] tokens; RoPE tables [N, D] come as an argument.
COGVIDEOX_TOKEN_SITES = (TokenSite("patch_embed", dim=1), TokenSite("image_rotary_emb", dim=0, argument=True))

ADAPTERS = (
    ModelAdapter("wan", "WanTransformer3DModel", (("blocks", "attn1"),), frames_dim=2, text_first=False,
                 patch_sizes=_wan_patch, token_sites=WAN_TOKEN_SITES),
    # ChronoEdit: Wan's layout (its RoPE skips frames in time, per position as Wan's).
    ModelAdapter("chronoedit", "ChronoEditTransformer3DModel", (("blocks", "attn1"),), frames_dim=2, text_first=False,
                 patch_sizes=_wan_patch, token_sites=WAN_TOKEN_SITES, latents="wan"),
    # SkyReels-V2: Wan's layout, but under diffusion forcing the per-frame timesteps become per-token tensors
    # inside the forward (no module output a hook could reorder): every sparse layer tiles its own q, k, v.
    ModelAdapter("skyreels_v2", "SkyReelsV2Transformer3DModel", (("blocks", "attn1"),), frames_dim=2,
                 text_first=False, patch_sizes=_wan_patch, token_sites=WAN_TOKEN_SITES, reorders_forward=_never,
                 latents="wan"),
    # Wan VACE: the control video's patch embedding is per token too, and the VACE blocks attend over it in the
    # video's token order (their self-attentions become sparse as well).
    ModelAdapter("wan_vace", "WanVACETransformer3DModel", (("vace_blocks", "attn1"), ("blocks", "attn1")),
                 frames_dim=2, text_first=False, patch_sizes=_wan_patch,
                 token_sites=WAN_TOKEN_SITES + (TokenSite("vace_patch_embedding", channels_first=True),),
                 latents="wan", required_inputs=("control_hidden_states",)),
    # HunyuanVideo: RoPE tables [N, D].
    ModelAdapter("hunyuan_video", "HunyuanVideoTransformer3DModel",
                 (("transformer_blocks", "attn"), ("single_transformer_blocks", "attn")), frames_dim=2,
                 text_first=False, patch_sizes=_square_patch,
                 token_sites=(TokenSite("x_embedder", dim=1), TokenSite("rope", dim=0)),
                 reorders_forward=_no_token_replace),
    ModelAdapter("cogvideox", "CogVideoXTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=1,
                 text_first=True, patch_sizes=_square_patch, token_sites=COGVIDEOX_TOKEN_SITES,
                 objective="v_prediction"),
    # ConsisID: CogVideoX's layout; its identity cross-attentions (perceiver) are per token and stay dense.
    ModelAdapter("consisid", "ConsisIDTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=1,
                 text_first=True, patch_sizes=_square_patch, token_sites=COGVIDEOX_TOKEN_SITES,
                 objective="v_prediction", latents="cogvideox"),
    # Wan-Animate: Wan's layout, but the pose latents are added to the patch embedding by frame and the face
    # adapter attends frame by frame (raster positions): every sparse layer tiles its own q, k, v. Its input is the
    # noisy latents followed by the reference latents and their mask (conditioning channels), with pose latents and
    # the face video in pixels beside.
    ModelAdapter("wan_animate", "WanAnimateTransformer3DModel", (("blocks", "attn1"),), frames_dim=2,
                 text_first=False, patch_sizes=_wan_patch, token_sites=(), reorders_forward=_never, latents="wan",
                 required_inputs=("pose_hidden_states", "face_pixel_values")),
    # EasyAnimate: text before video in one attention; the patch embedding runs per frame (no module output holds the
    # video tokens [B, N, C]), so every sparse layer tiles its own q, k, v. It takes no text mask (its pipeline pads
    # the text to a fixed length and the attention reads all of it).
    ModelAdapter("easyanimate", "EasyAnimateTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=2,
                 text_first=True, patch_sizes=_square_patch, token_sites=(), reorders_forward=_never, text_mask=False),
    # Cosmos (Predict 1 and 2): its patch embedding is channels-last [B, T, H, W, C] and video-to-world passes a
    # per-frame timestep [B, 1, T, 1, 1] that the forward expands per token: every sparse layer tiles its own q, k, v.
    # Predict 1 was trained with EDM preconditioning (sparsevid's training path takes flow families only).
    ModelAdapter("cosmos", "CosmosTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=2,
                 text_first=False, patch_sizes=_wan_patch, token_sites=(), reorders_forward=_never, objective="edm"),
    # Kandinsky 5: channels-last latents [B, T, H, W, C], flattened inside the forward (in raster order, or in 8x8
    # patches for its own NABLA sparse attention, whose mask over video tokens sparse attention refuses): every sparse
    # layer tiles its own q, k, v. Its forward takes the RoPE positions of the grid and of the text (no text mask) and
    # the pipeline's per-resolution RoPE scale_factor.
    ModelAdapter("kandinsky5", "Kandinsky5Transformer3DModel", (("visual_transformer_blocks", "self_attention"),),
                 frames_dim=1, text_first=False, patch_sizes=_wan_patch, token_sites=(), output_module="out_layer",
                 reorders_forward=_never, spatial_dims=(2, 3), call_inputs=("scale_factor",),
                 channels=_visual_cond_channels, zero_condition=True,
                 required_inputs=("pooled_projections", "scale_factor"), text_mask=False,
                 grid_positions="visual_rope_pos", text_positions="text_rope_pos", projections=KANDINSKY_PROJECTIONS),
    # Allegro: its patch embedding runs per frame and its RoPE comes as per-token grid positions: every sparse layer
    # tiles its own q, k, v. Trained with a discrete DDPM objective (not flow).
    ModelAdapter("allegro", "AllegroTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=2,
                 text_first=False, patch_sizes=_square_patch, token_sites=(), reorders_forward=_never,
                 objective="ddpm"),
    # LTX-2 (audio and video): its video self-attentions become sparse (audio, text and audio-video attentions stay
    # dense). Tokens [B, N, C] with the grid as arguments as LTX; per-token inputs (timestep, keyframe marks, a video
    # self-attention mask) and the audio-video attention's video RoPE are many: every sparse layer tiles its own
    # q, k, v.
    ModelAdapter("ltx2", "LTX2VideoTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=2,
                 text_first=False, patch_sizes=_square_patch, token_sites=(), reorders_forward=_never,
                 grid_arguments=("num_frames", "height", "width"),
                 training_refused="it denoises audio and video together in every forward (noisy audio latents are a "
                                  "required input and their velocity an output, at the video's noise level), while "
                                  "sparsevid's training data and objective hold video latents only"),
    # Kandinsky 6 (video and audio): Kandinsky 5's channels-last video layout; its video self-attentions become sparse
    # (audio, text and audio-video attentions stay dense); every sparse layer tiles its own q, k, v. Audio is optional
    # (its pipeline's sample_audio=False): training fine-tunes the video-only forward.
    ModelAdapter("kandinsky6", "Kandinsky6Transformer3DModel",
                 (("visual_transformer_blocks", "video_dec_block.self_attention"),), frames_dim=1, text_first=False,
                 patch_sizes=_wan_patch, token_sites=(), output_module="out_layer", reorders_forward=_never,
                 spatial_dims=(2, 3), channels=_visual_cond_channels, zero_condition=True,
                 required_inputs=("pooled_projections",), projections=KANDINSKY_PROJECTIONS),
    # HunyuanVideo FramePack: HunyuanVideo's blocks over [history (4x, 2x, 1x clean latents), video] tokens and text;
    # the history tokens lead the video and keep their place; its RoPE module also makes the history's tables (in
    # raster order, pooled): every sparse layer tiles its own video q, k, v.
    # Training data carry the history latents per sample and their frame indices (one set per batch).
    ModelAdapter("hunyuan_video_framepack", "HunyuanVideoFramepackTransformer3DModel",
                 (("transformer_blocks", "attn"), ("single_transformer_blocks", "attn")), frames_dim=2,
                 text_first=False, patch_sizes=_square_patch, token_sites=(), reorders_forward=_never,
                 call_tensors=FRAMEPACK_INDICES,
                 required_inputs=("encoder_attention_mask", "pooled_projections", "guidance", "image_embeds",
                                  "latents_clean", "latents_history_2x", "latents_history_4x", *FRAMEPACK_INDICES)),
    # HunyuanVideo 1.5: RoPE tables [N, D]; text (after the video) is padded per sample through a [B, 1, N, N] mask.
    # Its input is the noisy latents, conditioning latents and a mask channel (zeros for text-to-video); two text
    # encoders' states and image embeddings (zeros for text-to-video).
    ModelAdapter("hunyuan_video15", "HunyuanVideo15Transformer3DModel", (("transformer_blocks", "attn"),),
                 frames_dim=2, text_first=False, patch_sizes=_square_patch,
                 token_sites=(TokenSite("x_embedder", dim=1), TokenSite("rope", dim=0)), zero_condition=True,
                 required_inputs=("encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2",
                                  "image_embeds")),
    # Motif-Video: HunyuanVideo's layout (RoPE tables [N, D], text after the video); its decoder layers attend the
    # embedded video with the main stack's video tokens as context (both in the forward's token order). Its input is
    # the noisy latents, conditioning latents and a mask channel (zeros for text-to-video).
    ModelAdapter("motif_video", "MotifVideoTransformer3DModel",
                 (("transformer_blocks", "attn"), ("single_transformer_blocks", "attn")), frames_dim=2,
                 text_first=False, patch_sizes=_square_patch,
                 token_sites=(TokenSite("x_embedder", dim=1), TokenSite("rope", dim=0)), zero_condition=True),
    # LTX-Video: takes patched tokens [B, N, C] and the token grid as arguments; RoPE (cos, sin) [B, N, D]; image-
    # to-video and condition pipelines pass a per-token timestep [B, N]. A call without the grid (video_coords only)
    # runs sparse in raster order. The tokens are reordered as an argument, before diffusers' context-parallel plan
    # splits them (also before ``proj_in``, which is per token).
    ModelAdapter("ltx", "LTXVideoTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=2,
                 text_first=False, patch_sizes=_square_patch,
                 token_sites=(TokenSite("hidden_states", dim=1, argument=True), TokenSite("rope", dim=1),
                              TokenSite("timestep", dim=1, argument=True, min_dims=2)),
                 grid_arguments=("num_frames", "height", "width"), call_inputs=("rope_interpolation_scale",)),
    # Mochi: text after the video in one attention, but its processor attends each batch entry in a separate call over
    # [its video, its valid text] (packed into one call by the sparse layer); the patch embedding runs per frame
    # [B*T, H*W, C]; RoPE tables (cos, sin) [N, H, D/2]; timesteps inverted (1000 (1 - t), velocity x0 - noise).
    ModelAdapter("mochi", "MochiTransformer3DModel", (("transformer_blocks", "attn1"),), frames_dim=2,
                 text_first=False, patch_sizes=_square_patch,
                 token_sites=(TokenSite("patch_embed", frames_in_batch=True), TokenSite("rope", dim=0)),
                 inverted_time=True, needs_text_mask=True, batch_loop=True),
)


# Video transformers that block-sparse attention cannot serve, and why (adapter_for refuses them with the reason).
UNSUPPORTED = {
    "SanaVideoTransformer3DModel": "its video self-attention is linear attention (ReLU feature maps, no softmax "
                                   "score matrix): there are no attention tiles to skip",
    "WanAnimate2Transformer3DModel": "its self-attention already runs a structured flex BlockMask over a packed "
                                     "[generation | cached reference] buffer (frame-aligned reference keys from a KV "
                                     "cache), not a softmax over the video tokens that tiles could restrict",
    "LatteTransformer3DModel": "its attention is factorised into per-frame spatial and per-position temporal "
                               "attentions (each a short sequence): there is no space-time self-attention to tile",
}


def latent_families() -> set[str]:
    """The names of the latent spaces (VAE and text encoder) of the supported families' pipelines."""
    return {adapter.latents or adapter.name for adapter in ADAPTERS}


def adapter_for(transformer) -> ModelAdapter:
    """The adapter for ``transformer`` (matched on its class or a base class); TypeError if unsupported."""
    if not isinstance(transformer, torch.nn.Module):
        raise TypeError(f"transformer must be a torch.nn.Module (a diffusers transformer), "
                        f"got {type(transformer).__name__}")
    mro_names = {cls.__name__ for cls in type(transformer).__mro__}
    for class_name, reason in UNSUPPORTED.items():
        if class_name in mro_names:
            raise TypeError(f"{type(transformer).__name__} is not supported by sparse attention: {reason}")
    for adapter in ADAPTERS:
        if adapter.class_name in mro_names:
            return adapter
    supported = ", ".join(a.class_name for a in ADAPTERS)
    raise TypeError(f"transformer of type {type(transformer).__name__} is not supported; supported: {supported}")


def attention_heads(attn: torch.nn.Module) -> int:
    """The head count of a diffusers attention module (``heads``; Kandinsky 5 names it ``num_heads``)."""
    return attn.heads if hasattr(attn, "heads") else attn.num_heads


def _position(transformer: torch.nn.Module, name: str, args: tuple) -> int | None:
    """Index of forward argument ``name`` among the positional ``args`` of a call (None if not passed so)."""
    params = list(inspect.signature(transformer.forward).parameters)
    if name in params and params.index(name) < len(args):
        return params.index(name)
    return None


def forward_argument(transformer: torch.nn.Module, name: str, args: tuple, kwargs: dict):
    """The value of forward argument ``name`` in a call ``transformer(*args, **kwargs)`` (None if absent)."""
    if name in kwargs:
        return kwargs[name]
    position = _position(transformer, name, args)
    return None if position is None else args[position]


def replace_argument(transformer: torch.nn.Module, name: str, args: tuple, kwargs: dict, value) -> tuple[tuple, dict]:
    """(args, kwargs) of the call with forward argument ``name`` (passed either way) set to ``value``."""
    position = None if name in kwargs else _position(transformer, name, args)
    if position is None:
        return args, {**kwargs, name: value}
    return (*args[:position], value, *args[position + 1:]), kwargs
