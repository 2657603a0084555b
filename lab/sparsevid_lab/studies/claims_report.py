"""The claims grid's report: from ``grid.json`` (:mod:`sparsevid_lab.studies.claims_grid`), the per-entry table
and the three claims of trainable sparse attention, each stated as confirmed or not from the numbers alone.

"A beats B" means A is closer to the dense teacher on both yardsticks that do not depend on sampling luck
alone: higher PSNR of the sampled clips against the teacher's and lower velocity error against the teacher on
the held-out triples. Faithfulness and held-out loss are reported beside them.

    python3 -m sparsevid_lab.studies.claims_report OUT/grid.json [--png FIG.png]   # prints the Markdown section
    python3 -m sparsevid_lab.studies.claims_report SLICE/grid.json --matched FULL/grid.json   # claim 3's "above all"
    python3 -m sparsevid_lab.studies.claims_report BASE/grid.json --variant OTHER/grid.json   # a training variant, student by student

Claim 3 says distillation's lead over the diffusion loss is largest when the fine-tuning data differ from the
pre-training data. :func:`data_arms` compares the lead in a grid fine-tuned on the slice with the lead in a grid
fine-tuned on the whole distribution (``--fine-tune-on full``), entry by entry.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RULES = ("hybrid", "topk", "topp")
# The per-head calibrated mask plan (sparsevid.SparseConfig.from_calibration), beside the global rules.
PER_HEAD = "per-head"
GRID_RULES = RULES + (PER_HEAD,)
SPARSITY_TOLERANCE = 0.01  # achieved sparsities closer than this are "the same budget"
TARGET_FAITHFULNESS_GAP, TARGET_PSNR = 0.03, 24.0  # the distilled hybrid student at the highest sparsity


def entry_name(objective: str, rule: str, target: float) -> str:
    """Name of a grid entry: "distill_hybrid_95", "training-free_topk_63"."""
    return f"{objective}_{rule}_{round(target * 100):d}"


def _entries(grid: dict) -> dict:
    return {**grid["training_free"], **grid["students"]}


def beats(a: dict, b: dict) -> bool:
    """Whether entry ``a`` is closer to the teacher than ``b``: higher PSNR and lower velocity error."""
    return a["psnr"] > b["psnr"] and a["velocity_error"]["overall"] < b["velocity_error"]["overall"]


def _short(entry: dict) -> str:
    return f"{entry['psnr']:.2f} dB / {entry['velocity_error']['overall']:.4f}"


def paired_psnr_change(a: dict, b: dict) -> tuple[float, float] | None:
    """Mean and standard error of ``a``'s PSNR minus ``b``'s over the evaluation clips (paired clip by clip), or
    None without per-clip figures for both (or fewer than two clips)."""
    pa, pb = a.get("psnr_per_clip"), b.get("psnr_per_clip")
    if not pa or not pb or len(pa) != len(pb) or len(pa) < 2:
        return None
    diffs = [x - y for x, y in zip(pa, pb)]
    mean = sum(diffs) / len(diffs)
    variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, (variance / len(diffs)) ** 0.5


def clips_won(a: dict, b: dict) -> str:
    """On how many of the evaluation clips ``a``'s PSNR exceeds ``b``'s ("6/8"): whether a difference of the
    means holds clip by clip or rests on a few clips (the verdict itself uses the means)."""
    pa, pb = a.get("psnr_per_clip"), b.get("psnr_per_clip")
    if not pa or not pb or len(pa) != len(pb):
        return "per clip: -"
    return f"higher PSNR on {sum(x > y for x, y in zip(pa, pb))}/{len(pa)} clips"


def _compare(entries: dict, pairs: list[tuple[str, str]]) -> tuple[str, list[str]]:
    """(verdict, evidence lines) for "every first beats its second" over ``pairs`` of entry names."""
    missing = sorted({n for pair in pairs for n in pair if n not in entries})
    if missing:
        return "not measured", [f"missing: {', '.join(missing)}"]
    evidence, held = [], True
    for a, b in pairs:
        won = beats(entries[a], entries[b])
        held &= won
        evidence.append(f"{a} {_short(entries[a])} {'beats' if won else 'does not beat'} {b} {_short(entries[b])} "
                        f"({clips_won(entries[a], entries[b])})")
    return ("confirmed" if held else "not confirmed"), evidence


def fine_tuned_on_whole_distribution(settings: dict) -> bool:
    """Whether the grid's students were fine-tuned on the model's whole distribution (``--fine-tune-on full``)
    rather than the slice (grids from before ``--fine-tune-on`` existed used the slice)."""
    return settings.get("fine_tuning") == "full"


def fine_tuning_words(settings: dict) -> str:
    """What the students were fine-tuned on, in words."""
    if settings.get("fine_tuning") == "synthetic":
        return "the teacher's own samples"
    return "data like pre-training" if fine_tuned_on_whole_distribution(settings) else "mismatched data"


def claims(grid: dict) -> list[dict]:
    """Each claim at each target sparsity: {"claim", "target", "verdict", "evidence"}; plus the
    data-mismatch control and the target of the distilled hybrid student."""
    entries, targets = _entries(grid), grid["settings"]["targets"]
    data = fine_tuning_words(grid["settings"])
    found = []
    for target in targets:
        pairs1 = [(entry_name("distill", r, target), entry_name("training-free", r, target)) for r in RULES]
        pairs2 = [(entry_name("distill", "hybrid", target), entry_name("distill", r, target)) for r in ("topk", "topp")]
        pairs3 = [(entry_name("distill", r, target), entry_name("diffusion", r, target)) for r in RULES]
        for number, text, pairs in ((1, "trainable (distilled) beats training-free, for every rule", pairs1),
                                    (2, "hybrid beats top-k and top-p (distilled students)", pairs2),
                                    (3, f"distillation beats the diffusion loss on {data}, for every rule", pairs3)):
            verdict, evidence = _compare(entries, pairs)
            found.append({"claim": number, "text": text, "target": target, "verdict": verdict, "evidence": evidence})
    found.append(_control(grid))
    found.append(_target(grid, max(targets)))
    return found + per_head_claims(grid)


def per_head_claims(grid: dict) -> list[dict]:
    """At each target where the grid has a distilled per-head student: does the per-head calibrated mask plan beat
    the global top-k rule (distilled, same steps and data) at the same achieved sparsity (within
    ``SPARSITY_TOLERANCE``)? A pair whose sparsities differ by more is "not comparable"."""
    found = []
    for target in grid["settings"]["targets"]:
        mine, other = entry_name("distill", PER_HEAD, target), entry_name("distill", "topk", target)
        if mine not in grid["students"]:
            continue
        text = "the per-head calibrated mask plan beats the global top-k rule at the same sparsity (distilled)"
        verdict, evidence = _compare(grid["students"], [(mine, other)])
        if verdict != "not measured":
            gap = grid["students"][mine]["sparsity"] - grid["students"][other]["sparsity"]
            matched = abs(gap) <= SPARSITY_TOLERANCE
            evidence.append(f"achieved sparsity {grid['students'][mine]['sparsity']:.4f} against "
                            f"{grid['students'][other]['sparsity']:.4f} ({gap:+.4f}; "
                            f"{'within' if matched else 'NOT within'} {SPARSITY_TOLERANCE})")
            verdict = verdict if matched else "not comparable"
        found.append({"claim": PER_HEAD, "text": text, "target": target, "verdict": verdict, "evidence": evidence})
    return found


def _control(grid: dict) -> dict:
    """The data-mismatch control: the dense model fine-tuned with the diffusion loss on the slice loses
    quality against the teacher (lower faithfulness and higher held-out loss on captions outside the slice)."""
    dense, control = grid.get("dense"), grid["students"].get("dense_diffusion")
    claim = {"claim": "control", "target": None,
             "text": f"the fine-tuning data alone ({fine_tuning_words(grid['settings'])}; dense, diffusion loss) "
                     "lower the model's quality on held-out captions"}
    if dense is None or control is None:
        return {**claim, "verdict": "not measured", "evidence": ["missing: dense teacher or dense_diffusion"]}
    lower = control["faithfulness"]["overall"] < dense["faithfulness"]["overall"]
    higher = control["heldout_loss"]["overall"] > dense["heldout_loss"]["overall"]
    faith, loss = control["faithfulness"]["overall"], control["heldout_loss"]["overall"]
    evidence = [f"faithfulness {faith:.3f} (teacher {dense['faithfulness']['overall']:.3f}), held-out loss "
                f"{loss:.4f} (teacher {dense['heldout_loss']['overall']:.4f}), PSNR against the teacher "
                f"{control['psnr']:.2f} dB"]
    return {**claim, "verdict": "confirmed" if lower and higher else "not confirmed", "evidence": evidence}


def _target(grid: dict, target: float) -> dict:
    dense, student = grid.get("dense"), grid["students"].get(entry_name("distill", "hybrid", target))
    claim = {"claim": "target", "target": target,
             "text": f"the distilled hybrid student keeps faithfulness within {TARGET_FAITHFULNESS_GAP} of dense and "
                     f"reaches PSNR >= {TARGET_PSNR:.0f} dB"}
    if dense is None or student is None:
        return {**claim, "verdict": "not measured",
                "evidence": ["missing: dense teacher or the distilled hybrid student"]}
    gap = dense["faithfulness"]["overall"] - student["faithfulness"]["overall"]
    met = gap <= TARGET_FAITHFULNESS_GAP and student["psnr"] >= TARGET_PSNR
    return {**claim, "verdict": "met" if met else "not met",
            "evidence": [f"faithfulness gap {gap:.3f}, PSNR {student['psnr']:.2f} dB"]}


EVALUATION_SETTINGS = ("captions", "seeds", "sample_steps", "guidance", "heldout")
TRAINING_SETTINGS = ("slice", "fine_tuning", "steps", "batch", "clips", "lr", "trainable", "train_shift", "seed",
                     "data_seed", "synthetic_sampling")
# What must be equal in the two data arms for their entries to compare: the evaluation and the budget, all but the
# fine-tuning data (the teacher is checked by its measured yardsticks: a grid names it by where it was loaded from).
SHARED_SETTINGS = EVALUATION_SETTINGS + tuple(k for k in TRAINING_SETTINGS if k != "fine_tuning")


# The same teacher's held-out loss evaluated in bf16 on another GPU model (H100 against H200) differs in the fourth
# digit (0.091282 against 0.091249); another teacher differs by far more.
TEACHER_LOSS_RTOL = 1e-3


def _other_teacher(a: dict, b: dict) -> list[str]:
    """[] when two grids measured the same dense teacher (equal faithfulness, held-out losses within
    ``TEACHER_LOSS_RTOL``) or one of them did not measure it (a grid run without the dense evaluation), else [the
    difference]."""
    teachers = [(g["dense"]["faithfulness"]["overall"], g["dense"]["heldout_loss"]["overall"]) if g.get("dense")
                else None for g in (a, b)]
    if None in teachers or (teachers[0][0] == teachers[1][0]
                            and abs(teachers[0][1] - teachers[1][1]) <= TEACHER_LOSS_RTOL * abs(teachers[0][1])):
        return []
    return [f"the dense teacher's faithfulness and held-out loss ({teachers[0]} against {teachers[1]})"]


def _lead(grid: dict, rule: str, target: float) -> tuple[float, float] | None:
    """(PSNR gain in dB, velocity-error cut) of the distilled student over the diffusion-loss one, or None."""
    students = grid["students"]
    distill, diffusion = (students.get(entry_name(o, rule, target)) for o in ("distill", "diffusion"))
    if distill is None or diffusion is None:
        return None
    return (distill["psnr"] - diffusion["psnr"],
            diffusion["velocity_error"]["overall"] - distill["velocity_error"]["overall"])


def data_arms(mismatched: dict, matched: dict) -> dict:
    """Claim 3's "above all when the fine-tuning data differ from pre-training": distillation's lead over the
    diffusion loss (PSNR gain and velocity-error cut against the teacher) on the slice (``mismatched``) against
    its lead on the whole distribution (``matched``), for every (rule, target) both grids measured.

    Confirmed when the lead is larger on the slice on both yardsticks for every such pair. Returns {"verdict",
    "rows": [{"rule", "target", "mismatched": (psnr, velocity), "matched": (psnr, velocity)}], "larger_on_slice":
    {"psnr", "velocity", "both": how many pairs have the larger lead on the slice by that yardstick}}.
    Raises ValueError when the grids are not the two arms of one context."""
    if fine_tuned_on_whole_distribution(mismatched["settings"]) or not fine_tuned_on_whole_distribution(
            matched["settings"]):
        raise ValueError(f"mismatched and matched must be grids fine-tuned on the slice and on the whole "
                         f"distribution, got {fine_tuning_words(mismatched['settings'])} and "
                         f"{fine_tuning_words(matched['settings'])}")
    differ = [k for k in SHARED_SETTINGS if mismatched["settings"].get(k) != matched["settings"].get(k)]
    differ += _other_teacher(mismatched, matched)
    if differ:
        raise ValueError(f"the two grids differ in {', '.join(differ)}: their entries do not compare")
    rows = []
    for target in mismatched["settings"]["targets"]:
        for rule in RULES:
            leads = _lead(mismatched, rule, target), _lead(matched, rule, target)
            if None not in leads:
                rows.append({"rule": rule, "target": target, "mismatched": leads[0], "matched": leads[1]})
    larger = [(r["mismatched"][0] > r["matched"][0], r["mismatched"][1] > r["matched"][1]) for r in rows]
    counts = {"psnr": sum(p for p, _ in larger), "velocity": sum(v for _, v in larger),
              "both": sum(p and v for p, v in larger)}
    if not rows:
        return {"verdict": "not measured", "rows": [], "larger_on_slice": counts}
    verdict = "confirmed" if counts["both"] == len(rows) else "not confirmed"
    return {"verdict": verdict, "rows": rows, "larger_on_slice": counts}


def data_arms_markdown(mismatched: dict, matched: dict) -> str:
    """The comparison of :func:`data_arms` as a Markdown table and its verdict."""
    found = data_arms(mismatched, matched)
    lines = ["| rule | sparsity | PSNR gain, slice (dB) | PSNR gain, data like pre-training (dB) | "
             "velocity-error cut, slice | velocity-error cut, data like pre-training |", "|---|---|---|---|---|---|"]
    for r in found["rows"]:
        (ps, vs), (pm, vm) = r["mismatched"], r["matched"]
        lines.append(f"| {r['rule']} | {r['target']:.0%} | {ps:+.2f} | {pm:+.2f} | {vs:+.4f} | {vm:+.4f} |")
    lines += ["", f"Claim 3, distillation's lead over the diffusion loss is larger when the fine-tuning data differ "
                  f"from pre-training (both yardsticks, every pair): **{found['verdict']}**."]
    if found["rows"]:
        n, larger = len(found["rows"]), found["larger_on_slice"]
        lines.append(f"The lead is larger on the slice in {larger['both']} of {n} pairs on both yardsticks "
                     f"(PSNR gain: {larger['psnr']} of {n}; velocity-error cut: {larger['velocity']} of {n}).")
    return "\n".join(lines) + "\n"


# Grids from before --fine-tune-on existed fine-tuned on the slice; grids from before the seeds were recorded used
# claims_grid's default seeds.
SETTING_DEFAULTS = {"fine_tuning": "slice", "seed": 0, "data_seed": 1}


def _setting(grid: dict, key: str):
    return grid["settings"].get(key, SETTING_DEFAULTS.get(key))


def variant_comparison(base: dict, variant: dict) -> dict:
    """The students two grids both trained, compared one by one: a training variant (another time shift, other
    trainable parameters, another budget) against the base grid, judged on the same clips and triples.

    Returns {"changed": {setting: (base value, variant value)}, "rows": [{"name", "base", "variant",
    "clips_won"}]} (entries as in grid.json; clips_won: on how many clips the variant's PSNR is higher).
    Raises ValueError when the evaluation differs (other captions, seeds, sampler or held-out triples, or another
    teacher) or the grids share no student."""
    differ = [k for k in EVALUATION_SETTINGS if _setting(base, k) != _setting(variant, k)]
    differ += _other_teacher(base, variant)
    if differ:
        raise ValueError(f"base and variant are judged differently ({', '.join(differ)}): their students do not "
                         f"compare")
    names = [n for n in base["students"] if n in variant["students"]]
    if not names:
        raise ValueError(f"base and variant share no student (base: {sorted(base['students'])}, variant: "
                         f"{sorted(variant['students'])})")
    changed = {k: (_setting(base, k), _setting(variant, k)) for k in TRAINING_SETTINGS
               if _setting(base, k) != _setting(variant, k)}
    rows = [{"name": n, "base": base["students"][n], "variant": variant["students"][n],
             "clips_won": clips_won(variant["students"][n], base["students"][n])} for n in names]
    return {"changed": changed, "rows": rows}


def variant_markdown(base: dict, variant: dict) -> str:
    """The comparison of :func:`variant_comparison` as a Markdown table, headed by the settings that differ."""
    found = variant_comparison(base, variant)
    changed = "; ".join(f"{k}: {json.dumps(b)} -> {json.dumps(v)}" for k, (b, v) in found["changed"].items())
    lines = [f"Training settings changed (base -> variant): {changed or 'none'}.", "",
             "| student | sparsity base / variant | PSNR base / variant (dB) | change | per clip (mean +- s.e.) | "
             "velocity error base / variant | faithfulness base / variant |", "|---|---|---|---|---|---|---|"]
    for r in found["rows"]:
        b, v = r["base"], r["variant"]
        paired = paired_psnr_change(v, b)
        per_clip = "-" if paired is None else f"{paired[0]:+.2f} +- {paired[1]:.2f} dB"
        lines.append(f"| {r['name']} | {b['sparsity']:.3f} / {v['sparsity']:.3f} | {b['psnr']:.2f} / {v['psnr']:.2f} | "
                     f"{v['psnr'] - b['psnr']:+.2f} dB, {r['clips_won']} | {per_clip} | "
                     f"{b['velocity_error']['overall']:.4f} / "
                     f"{v['velocity_error']['overall']:.4f} | {b['faithfulness']['overall']:.3f} / "
                     f"{v['faithfulness']['overall']:.3f} |")
    return "\n".join(lines) + "\n"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def entry_table(grid: dict) -> list[str]:
    """One row per grid entry: the dense teacher, the noise floor, training-free rules and students."""
    rows = [("dense teacher", grid.get("dense"))] if grid.get("dense") else []
    if grid.get("noise_floor"):
        rows.append(("every tile kept (noise floor)", grid["noise_floor"]))
    rows += list(_entries(grid).items())
    attributes = sorted({a for _, e in rows for a in e["faithfulness"]["per_attribute"]})
    lines = ["| entry | sparsity | PSNR (dB) | SSIM | velocity error | held-out loss | faithfulness | "
             + " | ".join(attributes) + " | train loss |",
             "|---|---|---|---|---|---|---|" + "---|" * len(attributes) + "---|"]
    for name, e in rows:
        training = e.get("training") or {}
        loss = (f"{training['first_loss']:.4f} -> {training['last_loss']:.4f}"
                if training.get("first_loss") is not None else "-")
        velocity = e.get("velocity_error", {}).get("overall")
        lines.append(f"| {name} | {_fmt(e.get('sparsity'), '.3f')} | {_fmt(e.get('psnr'), '.2f')} | "
                     f"{_fmt(e.get('ssim'), '.4f')} | {_fmt(velocity, '.4f')} | {e['heldout_loss']['overall']:.4f} | "
                     f"{e['faithfulness']['overall']:.3f} | "
                     + " | ".join(_fmt(e["faithfulness"]["per_attribute"].get(a), ".3f") for a in attributes)
                     + f" | {loss} |")
    return lines


def grid_markdown(grid: dict) -> str:
    """The report section: settings, the table and every claim with its verdict and numbers."""
    s = grid["settings"]
    floor = grid.get("noise_floor")
    data = ("clips of the model's whole distribution (data like pre-training)" if fine_tuned_on_whole_distribution(s)
            else f"samples of the teacher (dense) for the captions of the slice {json.dumps(s['slice'])}"
            if s.get("fine_tuning") == "synthetic" else f"clips of the slice {json.dumps(s['slice'])}")
    lines = [f"Teacher `{s['model']}` on {s['device']}; every student: {s['steps']} steps x batch {s['batch']} on "
             f"{s['clips']} distinct {data}, lr {s['lr']}, trainable "
             f"{s['trainable']}"
             + ("" if s.get("train_shift") is None else f", noise levels drawn at time shift {s['train_shift']}")
             + f". Judged on {len(s['captions'])} held-out captions x {len(s['seeds'])} seeds "
             f"({s['sample_steps']} steps, guidance {s['guidance']}) and {s['heldout']['triples']} held-out "
             f"triples outside the slice {json.dumps(s['slice'])}."
             + (f" Noise floor: PSNR {floor['psnr']:.2f} dB, SSIM {floor['ssim']:.4f}." if floor else ""), ""]
    if grid.get("missing"):
        lines += [f"Not measured yet: {', '.join(grid['missing'])}.", ""]
    lines += entry_table(grid) + ["", "| claim | sparsity | verdict | numbers (PSNR / velocity error) |",
                                  "|---|---|---|---|"]
    for c in claims(grid):
        target = "-" if c["target"] is None else f"{c['target']:.0%}"
        lines.append(f"| {c['claim']}: {c['text']} | {target} | **{c['verdict']}** | {'; '.join(c['evidence'])} |")
    return "\n".join(lines) + "\n"


OBJECTIVE_COLOURS = {"training-free": "0.6", "diffusion": "tab:orange", "distill": "tab:blue"}


def plot_grid(grid: dict, path: str | Path) -> Path:
    """PNG: PSNR against the dense teacher per rule and objective, one panel per target sparsity, with the dense
    control (diffusion loss) and the PSNR target as lines and the noise floor in the title."""
    from ..eval.plots import pyplot, save_figure

    entries, targets = _entries(grid), grid["settings"]["targets"]
    rules = [r for r in GRID_RULES if r in RULES or any(entry_name(o, r, t) in entries for o in OBJECTIVE_COLOURS
                                                        for t in targets)]
    fig, axes = pyplot().subplots(1, len(targets), figsize=(4.2 * len(targets), 3.6), dpi=120, sharey=True,
                                  squeeze=False)
    width = 0.8 / len(OBJECTIVE_COLOURS)
    for ax, target in zip(axes[0], targets):
        for i, (objective, colour) in enumerate(OBJECTIVE_COLOURS.items()):
            found = [(x, entries.get(entry_name(objective, rule, target))) for x, rule in enumerate(rules)]
            found = [(x, entry["psnr"]) for x, entry in found if entry is not None]
            if found:
                offset = (i - (len(OBJECTIVE_COLOURS) - 1) / 2) * width  # the objectives' bars centred on the rule
                bars = ax.bar([x + offset for x, _ in found], [psnr for _, psnr in found], width,
                              color=colour, label=objective)
                ax.bar_label(bars, fmt="%.1f", fontsize=7)
        control = grid["students"].get("dense_diffusion")
        if control is not None:
            ax.axhline(control["psnr"], color="tab:orange", ls="--", lw=1, label="dense, diffusion loss")
        ax.axhline(TARGET_PSNR, color="k", ls=":", lw=1, label=f"target {TARGET_PSNR:.0f} dB")
        ax.set_xticks(range(len(rules)), rules)
        ax.set_title(f"{target:.0%} sparsity")
        ax.grid(axis="y", alpha=0.3)
    top = max([TARGET_PSNR] + [e["psnr"] for e in entries.values() if e.get("psnr") is not None])
    axes[0][0].set_ylim(0, top + 3)
    axes[0][0].set_ylabel("PSNR against dense (dB)")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    floor = grid.get("noise_floor")
    fig.suptitle(f"Sparse students (fine-tuned on {fine_tuning_words(grid['settings'])}) and training-free rules "
                 "against the dense teacher" + (f" (noise floor {floor['psnr']:.1f} dB)" if floor else ""), fontsize=9)
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The claims grid's report from its grid.json.")
    parser.add_argument("grid", type=Path, help="OUT/grid.json of sparsevid_lab.studies.claims_grid")
    parser.add_argument("--png", type=Path, default=None, help="also draw the PSNR figure (plot_grid) here")
    parser.add_argument("--matched", type=Path, default=None,
                        help="grid.json of the same grid fine-tuned on the whole distribution (--fine-tune-on full): "
                             "print distillation's lead in both arms instead (claim 3's 'above all')")
    parser.add_argument("--variant", type=Path, default=None,
                        help="grid.json of the same grid with other training settings (e.g. --train-shift, "
                             "--trainable): print their common students side by side instead")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    grid = json.loads(args.grid.read_text())
    if args.variant is not None:
        print(variant_markdown(grid, json.loads(args.variant.read_text())), end="")
        return 0
    if args.matched is not None:
        print(data_arms_markdown(grid, json.loads(args.matched.read_text())), end="")
        return 0
    print(grid_markdown(grid), end="")
    if args.png is not None:
        print(f"wrote {plot_grid(grid, args.png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
