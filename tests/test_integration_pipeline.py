"""WanPipeline end to end with sparse attention (tiny components from configs, precomputed prompt embeddings)."""
import pytest
import torch

import sparsevid as sv

diffusers = pytest.importorskip("diffusers")

SMALL_BLOCKS = {"block_q": 64, "block_k": 64}


def _transformer(seed=0):
    torch.manual_seed(seed)
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32).eval()


def _pipeline():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True]).eval()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0)
    return diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler,
                                 transformer=_transformer())


def _generate(pipe, steps=3):
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 10, 32, generator=generator)
    negative = torch.randn(1, 10, 32, generator=generator)
    # 9 frames of 128 x 160 -> latent 3 x 16 x 20 -> 3 x 8 x 10 = 240 video tokens.
    return pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, guidance_scale=5.0, num_frames=9,
                height=128, width=160, num_inference_steps=steps, generator=generator, output_type="pt").frames


def test_wan_pipeline_runs_end_to_end_with_sparse_attention():
    pipe = _pipeline()
    dense = _generate(pipe)
    sv.apply_sparse_attention(pipe.transformer, sv.SparseConfig(rule="topk", topk=0.3, dense_steps=1, **SMALL_BLOCKS),
                              collect_stats=True)
    sparse = _generate(pipe)
    # Two transformer calls per step (classifier-free guidance) still count as one denoising step.
    assert sv.denoising_step(pipe.transformer) == 2
    stats = sv.attention_stats(pipe.transformer)
    assert len(stats) == 2 and all(not s["dense"] and s["sparsity"] > 0.3 for s in stats)
    assert dense.shape == sparse.shape == (1, 9, 3, 128, 160)
    assert torch.isfinite(sparse).all()
    assert (sparse - dense).abs().max() > 1e-4
    # A new generation starts again at step 0 (dense warm-up): keeping every tile then reproduces dense.
    sv.apply_sparse_attention(pipe.transformer, sv.SparseConfig(rule="topk", topk=1.0, **SMALL_BLOCKS))
    assert torch.allclose(_generate(pipe), dense, atol=1e-4)
    sv.remove_sparse_attention(pipe.transformer)
    assert torch.equal(_generate(pipe), dense)


def test_a_pipeline_with_two_transformers_gets_each_its_own_setting():
    """Wan2.2's two-expert pipelines carry `transformer` and `transformer_2`: one call applies to both (or a setting
    per name), stats come per transformer, one call removes them all."""
    pipe = _pipeline()
    pipe.register_modules(transformer_2=_transformer(seed=1))
    assert set(sv.integration.pipeline_transformers(pipe)) == {"transformer", "transformer_2"}
    dense = _generate(pipe)
    sv.apply_sparse_attention(pipe, sv.SparseConfig(rule="topk", topk=0.3, **SMALL_BLOCKS), collect_stats=True)
    assert sv.is_sparse(pipe.transformer) and sv.is_sparse(pipe.transformer_2) and sv.is_sparse(pipe)
    sparse = _generate(pipe)
    stats = sv.attention_stats(pipe)
    assert set(stats) == {"transformer", "transformer_2"} and all(s["sparsity"] > 0 for s in stats["transformer"])
    assert not torch.allclose(sparse, dense)
    sv.remove_sparse_attention(pipe)
    assert not sv.is_sparse(pipe) and torch.equal(_generate(pipe), dense)

    sv.apply_sparse_attention(pipe, {"transformer_2": sv.SparseConfig(rule="topk", topk=0.3, **SMALL_BLOCKS)})
    assert sv.is_sparse(pipe.transformer_2) and not sv.is_sparse(pipe.transformer)
    with pytest.raises(ValueError, match="transformer_3"):
        sv.apply_sparse_attention(pipe, {"transformer_3": sv.SparseConfig()})
    with pytest.raises(TypeError, match="pipeline holding one"):
        sv.apply_sparse_attention(object(), sv.SparseConfig())
