"""Sparse students against their dense teacher: sample the same captions and seeds with the reference
model (dense attention) and with each candidate (a model with a sparse configuration, e.g. a distilled
student or the reference itself training-free), and report PSNR / SSIM of each candidate's clips against
the reference clips, with the achieved sparsity and sampling time."""
from __future__ import annotations

from typing import Sequence


def compare_to_reference(reference, candidates: dict, captions: Sequence[str], seeds: Sequence[int],
                         steps: int | None = None, guidance: float | None = None) -> dict:
    """PSNR / SSIM of each candidate's clips against ``reference``'s dense clips.

    reference: a dense :class:`~sparsevid_lab.model.builtin.BuiltinVideoDiT`; candidates: {label: (model, SparseConfig)}
    (the model may be ``reference`` itself; sparse attention is applied for the candidate's run and
    removed after). Every caption is sampled with every seed, one clip at a time. Returns {"reference":
    {"seconds"}, "candidates": {label: {"config", "sparsity" (mean over its self-attention calls), "psnr",
    "ssim" (means), "psnr_per_clip", "ssim_per_clip", "seconds"}}} and "clips" (label -> float32
    [n, 3, T, H, W], not JSON).
    """
    from sparsevid.integration import is_sparse
    from .harness import sample_dense, sample_with_stats, summarize_calls
    from sparsevid.eval.video_metrics import clip_similarity

    if not candidates:
        raise ValueError("candidates must name at least one (model, SparseConfig) pair")
    jobs = [(c, s) for c in captions for s in seeds]
    if not jobs:
        raise ValueError("captions and seeds must not be empty")
    if is_sparse(reference.transformer):
        raise ValueError("reference must run dense attention (remove its sparse attention first)")
    dense, dense_s = sample_dense(reference, jobs, steps, guidance)
    results = {"reference": {"seconds": dense_s}, "candidates": {}, "clips": {"reference": dense}}
    for label, (model, config) in candidates.items():
        clips, seconds, calls = sample_with_stats(model, config, jobs, steps, guidance)
        similarity = clip_similarity(clips, dense)
        results["candidates"][label] = {
            "config": config.to_dict(), "sparsity": summarize_calls(calls)["sparsity"],
            "psnr": sum(similarity["psnr"]) / len(jobs), "ssim": sum(similarity["ssim"]) / len(jobs),
            "psnr_per_clip": similarity["psnr"], "ssim_per_clip": similarity["ssim"], "seconds": seconds}
        results["clips"][label] = clips
    return results


def comparison_table(results: dict) -> str:
    """Markdown: one row per candidate (achieved sparsity, PSNR / SSIM against the reference, sampling seconds)."""
    lines = ["| candidate | sparsity | PSNR vs reference (dB) | SSIM vs reference | seconds |", "|---|---|---|---|---|",
             f"| reference (dense) | 0.0% | - | - | {results['reference']['seconds']:.1f} |"]
    for label, r in results["candidates"].items():
        lines.append(f"| {label} | {r['sparsity']:.1%} | {r['psnr']:.2f} | {r['ssim']:.4f} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"
