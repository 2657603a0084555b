"""The peers benchmark's CPU parts: sparsevid's mask as FlashInfer's Hopper block map and the table of what ran
and why the rest did not, and its figure."""
import pytest
import torch

import sparsevid as sv
from benchmarks.bench_attention_peers import PEERS, chosen_peers, figure, flashinfer_blocks, markdown, sparge_tile


def test_flashinfer_blocks_repeat_each_query_block_as_64_row_blocks_per_head():
    generator = torch.Generator().manual_seed(0)
    keep = torch.rand(1, 3, 4, 7, generator=generator) < 0.4
    mask = sv.SparseMask.from_dense(keep, 7 * 64, 7 * 64, 128, 64)  # 4 query blocks of 128, the last half used
    blocks = flashinfer_blocks(mask)
    assert blocks.shape == (3, 7, 7) and blocks.dtype == torch.bool
    for row in range(7):
        assert torch.equal(blocks[:, row], keep[0, :, row // 2])


@pytest.mark.parametrize("batch, block_k, length", [(2, 64, 512), (1, 128, 512), (1, 64, 500)])
def test_flashinfer_blocks_refuse_what_the_kernels_do_not_take(batch, block_k, length):
    keep = torch.ones(batch, 2, -(-length // 128), -(-length // block_k), dtype=torch.bool)
    with pytest.raises(ValueError, match="64-token key blocks"):
        flashinfer_blocks(sv.SparseMask.from_dense(keep, length, length, 128, block_k))


def test_the_table_gives_times_for_peers_that_ran_and_the_reason_for_the_others():
    common = {"shape": "wan1.3b-480p", "block": "128x64", "sparsity": 0.95}
    table = markdown([{**common, "peer": "sparsevid bf16", "ran": True, "ms": 0.69, "x_cudnn": 16.8},
                      {**common, "peer": "sageattention (dense)", "ran": True, "ms": 9.0, "x_cudnn": 1.3,
                       "ms_at_kept_share": 0.45, "cosine": 0.9991, "rel_l1": 0.031},
                      {**common, "peer": "flashinfer block-sparse bf16", "ran": False,
                       "why": "ModuleNotFoundError: No module named 'flashinfer'"},
                      {**common, "peer": "flash-attn-4 block-sparse bf16", "ran": True, "ms": 0.6, "x_cudnn": 19.3,
                       "cosine": 0.99999, "rel_l1": 0.003, "fwdbwd_ms": 2.5, "x_cudnn_fwdbwd": 16.1,
                       "grad_rel_l1": 0.0042},
                      {**common, "peer": "flash-attn-4 block-sparse bf16", "ran": True, "ms": 0.6, "x_cudnn": 19.3,
                       "fwdbwd_why": "ValueError: key blocks of 128 tokens"}])
    lines = table.splitlines()
    assert lines[2].startswith("| wan1.3b-480p | 128x64 | 0.950 | sparsevid bf16 |")
    assert "| 0.690 | 16.8x | - | - | - | - | - |  |" in lines[2]
    assert "| 9.000 | 1.3x | 0.450 | 0.99910 / 0.0310 | - | - | - |  |" in lines[3]
    assert lines[4].endswith("| - | - | - | - | - | - | - | ModuleNotFoundError: No module named 'flashinfer' |")
    assert "| 0.99999 / 0.0030 | 2.500 | 16.1x | 0.0042 |  |" in lines[5]
    assert lines[6].endswith("| - | - | - | ValueError: key blocks of 128 tokens |")


def test_sparge_tiles_are_64_by_128_on_hopper_and_128_by_64_elsewhere():
    assert sparge_tile((9, 0)) == (64, 128)
    assert sparge_tile((8, 9)) == sparge_tile((8, 0)) == (128, 64)


def test_the_figure_has_one_panel_per_shape_tile_and_sparsity_with_a_bar_per_peer_that_ran():
    common = {"shape": "wan1.3b-480p-64", "sparsity": 0.95}
    rows = [{**common, "block": "128x64", "peer": "sparsevid bf16", "ran": True, "ms": 0.69},
            {**common, "block": "128x64", "peer": "flashinfer block-sparse bf16", "ran": True, "ms": 0.57},
            {**common, "block": "64x128", "peer": "sparsevid bf16", "ran": True, "ms": 0.86},
            {**common, "block": "64x128", "peer": "flashinfer block-sparse bf16", "ran": False, "why": "tiles"}]
    fig = figure(rows, {"gpu": "NVIDIA H100", "commit": "abc1234"})
    panels = fig.axes
    assert [ax.get_title() for ax in panels] == ["wan1.3b-480p-64, 128x64 tiles, 95.0% sparse",
                                                 "wan1.3b-480p-64, 64x128 tiles, 95.0% sparse"]
    assert [[bar.get_width() for bar in ax.patches] for ax in panels] == [[0.69, 0.57], [0.86]]


def test_peers_are_chosen_by_parts_of_their_names_and_an_unknown_part_is_refused():
    assert chosen_peers("all") == list(PEERS)
    assert chosen_peers("flash-attn-4") == ["flash-attn-4 block-sparse bf16"]
    assert chosen_peers("spargeattn, flashinfer block-sparse sage") == ["flashinfer block-sparse sage fp8",
                                                                      "spargeattn block-sparse"]
    for names in ("flash-attn-5", ",", ""):
        with pytest.raises(ValueError, match="--peers"):
            chosen_peers(names)
