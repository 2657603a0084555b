"""The three claims of trainable sparse attention, tested on the built-in model at its long clip.

Grid: at every target sparsity, {training-free, diffusion-loss fine-tuning, velocity distillation} x {top-k,
top-p, hybrid}, every rule calibrated on the dense teacher to the same sparsity, plus a dense model fine-tuned
with the diffusion loss on the same data (the data-mismatch control). Every student gets the same budget
(steps, batch, distinct clips) on a narrow slice of the procedural scenes (by default one background, single
objects, two motions) and is judged, against the dense teacher, on captions that slice cannot produce.

With ``--rules per-head topk --objectives distill`` the grid compares mask plans instead (issue 35): students
distilled with the per-head calibrated plan (the library's ``calibrate_heads`` on the teacher, loaded with
``SparseConfig.from_calibration``, allocated for the sparsity global top-k reaches) against students distilled
with global top-k, same steps, data and evaluation; ``grid.md`` states whether the per-head student beats top-k at
the same achieved sparsity (``lab/scripts/calibrated_students.sh``).

The run is split into parts that each fit one GPU call (``--budget-minutes``) and resume from ``--out``:

* ``plan``: the pending students and how they pack into calls, from the timing figures (no model needed);
* ``calibrate``: rule parameters of top-k, top-p and hybrid reaching each ``--targets`` sparsity on the
  teacher's attention (``OUT/calibration.json``, with the achieved sparsity of each; skipped once done), and the
  per-head plans where ``--rules`` names them (``OUT/heads_calibration.json``, the library's file, and its heat map);
* ``train``: the pending students in a fixed order, each trained, then evaluated at once (so a student's
  weights never need to survive the call), while at least ``MIN_TRAINING_SECONDS`` of training and one
  evaluation fit in the budget (estimates come from the measured seconds per step of earlier students,
  ``OUT/timing.json``, or the H200 figures below). A student cut short by the budget keeps its training
  state in ``OUT/work/NAME`` and the next call resumes it;
* ``evaluate``: the dense teacher, the noise floor (every tile kept) and the training-free rules, as many as
  the budget allows; then the grid so far (``OUT/grid.json``, ``OUT/grid.md`` with the claims, ``OUT/grid.png``,
  :mod:`sparsevid_lab.studies.claims_report`; entries not measured yet are listed);
* ``report``: ``grid.json`` and ``grid.md`` again from the files alone (no model, no GPU), e.g. for every
  target once calls have run with one ``--targets`` each;
* ``ship``: the best student at the highest target sparsity (PSNR against dense) as a small asset
  (``--ship-to``; :func:`sparsevid_lab.model.sparse_student.load_sparse_student`).

Each student keeps only its fine-tuned tensors (``--trainable attention``: the self-attention modules, bf16,
about 3 MB for the built-in model) in ``OUT/students/NAME/`` beside its ``eval.json``.

    python3 -m sparsevid_lab.studies.claims_grid --out outputs/claims --part plan        # the calls it will take
    python3 -m sparsevid_lab.studies.claims_grid --out outputs/claims --part calibrate train evaluate   # repeat until
                                                                            # grid.md lists nothing missing
    python3 -m sparsevid_lab.studies.claims_grid --out outputs/claims --part ship --ship-to lab/sparsevid_lab/assets/sparse_student_95

CPU smoke run (untrained tiny model, seconds): ``--tiny --device cpu --steps 2 --batch 2 --captions 1
--heldout-per-bin 1 --noise-bins 2 --targets 0.5 0.75``.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from pathlib import Path

import torch

from .claims_report import GRID_RULES, PER_HEAD, RULES, entry_name, grid_markdown, plot_grid

OBJECTIVES = ("distill", "diffusion")
HEADS_CALIBRATION = "heads_calibration.json"  # the library's per-head calibration of the teacher (--rules per-head)
DENSE_CONTROL = "dense diffusion"
# Seconds per training step at batch 8 on the long clip (32 x 128 x 128) on one H200, used until this grid has
# measured its own: dense training 0.52 s (measured); a distillation step adds a teacher forward (~1/3 of that)
# and mask prediction (estimated).
H200_SECONDS_PER_STEP_AT_BATCH_8 = {"distill": 0.70, "diffusion": 0.55, DENSE_CONTROL: 0.52}
H200_SECONDS_PER_CLIP = 1.5  # sampling one long clip (10 UniPC steps, guidance 4), dense
EVAL_FIXED_SECONDS = 15.0  # held-out velocities and faithfulness scoring of one entry, beside its sampling
CALL_OVERHEAD_SECONDS = 60.0  # per call: imports, loading the teacher, its reference clips and velocities
# A student is started when this much training fits in the call besides an evaluation; if it does not finish,
# its state is checkpointed at the deadline and the next call resumes it.
MIN_TRAINING_SECONDS = 60.0


def student_name(objective: str, rule: str | None, target: float | None) -> str:
    """Folder name of a student: "distill_hybrid_95", "dense_diffusion"."""
    return "dense_diffusion" if rule is None else entry_name(objective, rule, target)


def student_plan(targets: list[float], rules=RULES, objectives=OBJECTIVES) -> list[dict]:
    """Every student of the grid, in training order: per target sparsity, each rule with each objective
    (so that the comparisons of one sparsity complete together); the dense control (a diffusion-loss
    student) last, when the diffusion objective is in ``objectives``."""
    plan = [{"name": student_name(objective, rule, target), "objective": objective, "rule": rule, "target": target}
            for target in targets for rule in rules for objective in OBJECTIVES if objective in objectives]
    if "diffusion" in objectives:
        plan.append({"name": student_name("diffusion", None, None), "objective": "diffusion", "rule": None,
                     "target": None})
    return plan


def rule_label(rule: str, target: float) -> str:
    """The calibration's label of a rule at a target ("hybrid 95%", as ``calibrate_rules`` names it)."""
    return f"{rule} {target:.0%}"


def reference_name(rule: str, target: float) -> str:
    """File stem of a training-free entry under ``OUT/reference`` ("hybrid_95")."""
    return rule_label(rule, target).replace(" ", "_").rstrip("%")


class Grid:
    """The grid's files under ``out`` and what its parts share: the teacher, the data slice, the held-out
    captions and triples, and the clock of this call."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = args.started + args.budget_minutes * 60
        self.device = torch.device(args.device)
        self._teacher = self._context = None

    # ---- files
    def path(self, *parts) -> Path:
        return self.out.joinpath(*parts)

    def read(self, *parts) -> dict | None:
        path = self.path(*parts)
        return json.loads(path.read_text()) if path.is_file() else None

    def write(self, data: dict, *parts) -> Path:
        path = self.path(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2))
        return path

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    # ---- the models and data
    def _loaded_teacher(self):
        """The dense teacher as loaded once per call (bf16 on CUDA, fp32 on the CPU, as the CLI loads it)."""
        from ..cli.demo import load_model

        if self._teacher is None:
            self._teacher = load_model(argparse.Namespace(tiny=self.args.tiny, model=self.args.model,
                                                          device=self.args.device, clip=self.args.clip))
        return self._teacher

    @property
    def eval_dtype(self) -> torch.dtype:
        """The dtype models are evaluated in: the teacher's as loaded."""
        return next(self._loaded_teacher().parameters()).dtype

    def teacher(self, dtype: torch.dtype | None = None):
        """A fresh copy of the dense teacher (in ``dtype``, e.g. fp32 for training; default the evaluation dtype)."""
        model = copy.deepcopy(self._loaded_teacher())
        return model if dtype is None else model.to(dtype)

    def data_slice(self, model):
        """The narrow slice of the model's procedural scenes (``--backgrounds``, ``--max-objects``, ...): the
        evaluation's captions and triples lie outside it, whatever the students are fine-tuned on."""
        from ..data import ProceduralVideos

        a = self.args
        words = {name: value for name, value in (("backgrounds", a.backgrounds), ("colours", a.colours),
                                                 ("motions", a.motions)) if value}
        return ProceduralVideos(**{**model.data.config(), "max_objects": a.max_objects, **words})

    def fine_tuning_data(self, model):
        """What the students are fine-tuned on: the slice (data unlike pre-training) or, with
        ``--fine-tune-on full``, the model's whole procedural distribution (data like pre-training)."""
        return model.data if self.args.fine_tune_on == "full" else self.data_slice(model)

    def fine_tuning_source(self, model):
        """The students' latent source: the procedural clips of :meth:`fine_tuning_data` (through the caption
        encoder), or with ``--fine-tune-on synthetic`` the shard folder ``--part cache`` wrote (the teacher's own
        samples of the slice's captions, made by ``sparsevid.data.cache_synthetic``)."""
        from sparsevid.training import LatentDirectory

        from ..data.sources import ProceduralSource
        from ..model.builtin import CaptionedClips

        a = self.args
        if a.fine_tune_on == "synthetic":
            return LatentDirectory(self.path("synthetic"), seed=a.data_seed)
        return CaptionedClips(model, ProceduralSource(self.fine_tuning_data(model), seed=a.data_seed, clips=a.clips))

    def training_shift(self, teacher) -> float:
        """Time shift of the students' training noise levels: ``--train-shift``, else the teacher's pre-training
        one (the sampler's, 5 for the shipped model, puts most of its steps at higher noise levels)."""
        from ..model.builtin import pretraining_noise

        return pretraining_noise(teacher, self.args.train_shift)[0]

    def context(self) -> dict:
        """What every evaluation compares against (computed once per call): held-out captions x seeds, the
        teacher's dense clips of them, held-out (clip, noise, t) triples outside the slice and the teacher's
        velocity on them."""
        from ..data import held_out_captions
        from ..eval.harness import sample_dense
        from ..eval.heldout import heldout_set, predict_velocities

        if self._context is None:
            a = self.args
            earlier = self.read("context.json")  # grids from before --fine-tune-on fine-tuned on the slice
            arm = None if earlier is None else earlier.get("fine_tuning", "slice")
            if arm is not None and arm != a.fine_tune_on:
                raise ValueError(f"{self.out} holds a grid fine-tuned on {arm!r}, not --fine-tune-on "
                                 f"{a.fine_tune_on}: give the other arm its own --out")
            teacher = self.teacher()
            data = self.data_slice(teacher)
            captions = held_out_captions(teacher.data, data, a.captions, seed=a.caption_seed)
            jobs = [(c, s) for c in captions for s in a.seeds]
            steps = a.sample_steps or teacher.config["sampling"]["steps"]
            texts = [c for c, _ in jobs]
            dense, seconds = sample_dense(teacher, jobs, steps, a.guidance)
            heldout = heldout_set(teacher, teacher.data, a.heldout_per_bin, a.noise_bins, exclude=data)
            self._context = {"jobs": jobs, "texts": texts, "steps": steps, "dense": dense,
                             "dense_seconds": seconds, "heldout": heldout,
                             "reference_velocity": predict_velocities(teacher, heldout), "slice": data.config(),
                             "fine_tuning": self.args.fine_tune_on,
                             "guidance": teacher.config["sampling"]["guidance"] if a.guidance is None else a.guidance}
            self.write(self.describe_context(), "context.json")
        return self._context

    def describe_context(self) -> dict:
        """What the evaluation compares against, in words (``context.json``, read by ``--part report``)."""
        context = self._context
        return {"slice": context["slice"], "fine_tuning": context["fine_tuning"], "captions": context["texts"],
                "seeds": self.args.seeds,
                "sample_steps": context["steps"], "guidance": context["guidance"],
                "heldout": context["heldout"].describe(),
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)}

    # ---- timing
    def seconds_per_step(self, kind: str) -> float:
        """Measured (``timing.json``) or estimated seconds per training step of ``kind`` (an objective or the
        dense control) at this grid's batch size."""
        measured = (self.read("timing.json") or {}).get(kind)
        if measured is not None:
            return measured
        return H200_SECONDS_PER_STEP_AT_BATCH_8[kind] * self.args.batch / 8

    def eval_seconds(self) -> float:
        measured = (self.read("timing.json") or {}).get("eval")
        if measured is not None:
            return measured
        return len(self.args.seeds) * self.args.captions * H200_SECONDS_PER_CLIP + EVAL_FIXED_SECONDS

    def record_timing(self, kind: str, seconds: float) -> None:
        timing = self.read("timing.json") or {}
        timing[kind] = round(seconds, 4)
        self.write(timing, "timing.json")


def calibration_configs(grid: Grid) -> dict:
    """{label: SparseConfig} from ``calibration.json`` (ValueError if a target has not been calibrated)."""
    from sparsevid.plan import SparseConfig

    calibration = grid.read("calibration.json")
    if calibration is None:
        raise ValueError(f"{grid.path('calibration.json')} not found: run --part calibrate first")
    configs = {label: SparseConfig.from_dict(entry["config"]) for label, entry in calibration["rules"].items()}
    missing = [rule_label(r, t) for t in grid.args.targets for r in grid.args.rules if rule_label(r, t) not in configs]
    if missing:
        raise ValueError(f"calibration.json lacks {missing}: run --part calibrate with these --targets")
    return configs


def part_calibrate(grid: Grid) -> None:
    """Rule parameters reaching every target sparsity on the teacher's attention (first held-out caption), and
    with ``--rules per-head`` the per-head plans (:func:`per_head_rules`). Targets calibrated by an earlier call
    keep their parameters, so students and training-free entries of one target always share one calibration."""
    a = grid.args
    done = (grid.read("calibration.json") or {}).get("rules", {})
    missing = [t for t in a.targets if any(rule_label(r, t) not in done for r in RULES)]
    per_head = [t for t in a.targets if PER_HEAD in a.rules and rule_label(PER_HEAD, t) not in done]
    if not missing and not per_head:
        print(f"calibrate: {grid.path('calibration.json')} already holds every target")
        return
    context = grid.context()
    caption, seed = context["jobs"][0]
    rules = dict(done)
    if missing:
        rules.update(global_rules(grid, missing, caption, seed, context["steps"]))
    if per_head:
        rules.update(per_head_rules(grid, rules, per_head, caption, seed, context["steps"]))
    path = grid.write({"caption": caption, "seed": seed, "steps": context["steps"], "rules": rules},
                      "calibration.json")
    print(f"calibrate: wrote {path}")


def _report_calibrated(label: str, entry: dict) -> None:
    aim = entry.get("aimed", entry["target"])
    flag = "" if entry["within_one_point"] else f"  (NOT within 1 point of {aim:.4f})"
    print(f"calibrate: {label:<14} achieved {entry['achieved']:.4f}{flag}")


def global_rules(grid: Grid, targets: list[float], caption: str, seed: int, steps: int) -> dict:
    """{label: entry} of top-k, top-p and hybrid at ``targets``, calibrated on the teacher's attention while it
    samples (caption, seed)."""
    from sparsevid.eval import calibrate_rules, mean_sparsity
    from ..eval.recording import record_video_attention

    calls = record_video_attention(grid.teacher(), caption, seed, steps, grid.args.guidance)
    rules = {}
    for label, config in calibrate_rules(calls, targets).items():
        target = float(label.split()[1].rstrip("%")) / 100
        rule = config.to_dict()
        achieved = mean_sparsity(calls, block_q=config.block_q, block_k=config.block_k,
                                 **{k: rule[k] for k in ("rule", "topk", "topp")})
        rules[label] = {"config": rule, "target": target, "achieved": round(achieved, 4),
                        "within_one_point": abs(achieved - target) <= 0.01}
        _report_calibrated(label, rules[label])
    return rules


def per_head_rules(grid: Grid, rules: dict, targets: list[float], caption: str, seed: int, steps: int) -> dict:
    """{"per-head T%": entry} at ``targets``: the library's per-head calibration of the teacher
    (``calibrate_heads`` over its dense sampling of (caption, seed), the clip the global rules were calibrated on;
    measured once into ``OUT/heads_calibration.json`` with its seconds, and its heat map), allocated for the mean sparsity that
    global top-k reaches at the target on that clip (both arms remove the same share of attention) and loaded
    with ``SparseConfig.from_calibration``. Entry: config, target, "aimed" (top-k's sparsity), "achieved" (the
    allocation's mean sparsity on the clip), "within_one_point" (of the aim), "calibration" (the file)."""
    from sparsevid import SparseConfig
    from sparsevid.eval.calibrate import plot_calibration
    from sparsevid.plan.calibration import Calibration

    from ..cli.calibrate import calibrate_builtin

    path = grid.path(HEADS_CALIBRATION)
    if path.is_file():
        calibration = Calibration.load(path)
    else:
        start = time.perf_counter()
        calibration = calibrate_builtin(grid.teacher(), [(caption, seed)], steps, grid.args.guidance, progress=False)
        calibration.inputs.update(seconds=round(time.perf_counter() - start, 3), device=str(grid.device))
        print(f"calibrate: per-head calibration of the teacher in {calibration.inputs['seconds']:.1f} s")
    found = {}
    for target in targets:
        aim = rules[rule_label("topk", target)]["achieved"]
        calibration.choose(target_sparsity=aim)
        calibration.save(path)
        achieved = calibration.summary()["mean_sparsity"]
        label = rule_label(PER_HEAD, target)
        found[label] = {"config": SparseConfig.from_calibration(path).to_dict(), "target": target, "aimed": aim,
                        "achieved": round(achieved, 4), "within_one_point": abs(achieved - aim) <= 0.01,
                        "calibration": HEADS_CALIBRATION}
        _report_calibrated(label, found[label])
    plot_calibration(calibration, path.with_suffix(".png"))
    return found


def _student_config(student: dict, configs: dict):
    return None if student["rule"] is None else configs[rule_label(student["rule"], student["target"])]


def _timing_kind(student: dict) -> str:
    """The ``timing.json`` key of a student's training steps: its objective, or the dense control."""
    return DENSE_CONTROL if student["rule"] is None else student["objective"]


def _estimate(grid: Grid, student: dict) -> float:
    return grid.args.steps * grid.seconds_per_step(_timing_kind(student)) + grid.eval_seconds()


def pending_students(grid: Grid) -> list[dict]:
    """The students of the grid not evaluated yet, in training order."""
    return [s for s in student_plan(grid.args.targets, grid.args.rules, grid.args.objectives)
            if grid.read("students", s["name"], "eval.json") is None]


def part_train(grid: Grid) -> None:
    """Train and evaluate the pending students that fit in this call (see the module docstring)."""
    configs = calibration_configs(grid)
    grid.context()  # the teacher's clips and velocities, before the students' clock starts
    pending = pending_students(grid)
    total = sum(_estimate(grid, s) for s in pending)
    print(f"train: {len(pending)} students pending, about {total / 60:.1f} min of training and evaluation in all "
          f"({grid.seconds_left() / 60:.1f} min left in this call)")
    for student in pending:
        estimate = _estimate(grid, student)
        if grid.seconds_left() < grid.eval_seconds() + MIN_TRAINING_SECONDS:
            print(f"train: stopping before {student['name']} (about {estimate:.0f} s, {grid.seconds_left():.0f} s "
                  f"left); run --part train again")
            return
        print(f"train: {student['name']}: about {estimate:.0f} s")
        if not train_student(grid, student, _student_config(student, configs)):
            print(f"train: {student['name']} was cut short by the budget; its state is in "
                  f"{grid.path('work', student['name'])}; run --part train again")
            return
    print("train: every student is trained and evaluated")


def train_student(grid: Grid, student: dict, sparse) -> bool:
    """Fine-tune one student through the library's training path (the teacher's transformer, its caption
    encoder supplying the text states), keep its student folder, evaluate it. False if the budget cut it short."""
    from sparsevid import load_student, remove_sparse_attention
    from sparsevid.training import STUDENT_CONFIG, STUDENT_WEIGHTS, DistillConfig, LoopConfig, distill

    from ..model.builtin import pretraining_noise

    a, name = grid.args, student["name"]
    model = grid.teacher(torch.float32)
    config = DistillConfig(objective=student["objective"], sparse=sparse, trainable=a.trainable, batch_size=a.batch,
                           seed=a.seed, shift=grid.training_shift(model), null_prob=pretraining_noise(model)[1])
    # The time left after this student's evaluation; the schedule follows the step budget alone.
    stop_at = grid.deadline - grid.eval_seconds()
    loop = LoopConfig(lr=a.lr, warmup_steps=a.warmup, ema_decay=None, max_steps=a.steps, weight_decay=0.0,
                      bf16=True, log_every=max(1, a.steps // 10), checkpoint_every=max(1, a.steps // 4),
                      stop_at=stop_at)
    source = grid.fine_tuning_source(model)
    work = grid.path("work", name)
    done_before = _state_step(work)
    result = distill(model.transformer, source, config, loop, out=work, resume=True, device=grid.device,
                     extra={"student": name})
    if not result.finished:
        return False
    trained = result.steps - done_before
    if trained > 0 and result.seconds > 0:
        grid.record_timing(_timing_kind(student), result.seconds / max(result.steps, 1))
    rows = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines() if line.strip()]
    summary = {**student, "steps": result.steps, "batch": a.batch, "clips": a.clips, "lr": a.lr,
               "trainable": a.trainable, "seconds": round(result.seconds, 1),
               "first_loss": _mean([r["loss"] for r in rows[:10]]), "last_loss": _mean([r["loss"] for r in rows[-10:]]),
               "data": source.describe()}
    if sparse is not None:
        folder = grid.path("students", name)
        folder.mkdir(parents=True, exist_ok=True)
        for file in (STUDENT_WEIGHTS, STUDENT_CONFIG):
            shutil.copyfile(work / file, folder / file)
        remove_sparse_attention(model.transformer)
        # Evaluate what ships: the student as written (bf16 tensors) over the teacher's weights.
        model = grid.teacher()
        load_student(model.transformer, folder, apply=False)
    model.eval()
    start = time.time()
    entry = evaluate_entry(grid, model.to(grid.eval_dtype), sparse)
    grid.record_timing("eval", time.time() - start)
    grid.write({"training": summary, **entry}, "students", name, "eval.json")
    shutil.rmtree(work)  # the finished student's training state (its tensors and log summary are kept)
    print(f"train: {name}: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, PSNR "
          f"{entry['psnr']:.2f} dB, faithfulness {entry['faithfulness']['overall']:.3f}, "
          f"sparsity {entry['sparsity']:.3f}")
    return True


def _state_step(work: Path) -> int:
    from safetensors import safe_open

    state = work / "state.safetensors"
    if not state.is_file():
        return 0
    with safe_open(str(state), framework="pt") as f:
        return int((f.metadata() or {}).get("step", 0))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def evaluate_entry(grid: Grid, model, sparse) -> dict:
    """One grid entry (``model`` dense, run with ``sparse`` or densely if None) against the teacher on the
    held-out captions and triples: sparsity, PSNR / SSIM of its clips, caption faithfulness (overall and per
    attribute), velocity error against the teacher and held-out flow-matching loss (overall and per noise
    level), sampling seconds."""
    from ..eval.faithfulness_summary import summarize_faithfulness
    from ..eval.harness import sample_dense, sample_with_stats, summarize_calls
    from sparsevid.eval import heldout_loss, velocity_error

    from ..eval.heldout import predict_velocities
    from sparsevid.eval.video_metrics import psnr, ssim

    context = grid.context()
    if sparse is None:
        clips, seconds = sample_dense(model, context["jobs"], context["steps"], context["guidance"])
        sparsity = 0.0
    else:
        clips, seconds, calls = sample_with_stats(model, sparse, context["jobs"], context["steps"], context["guidance"])
        sparsity = summarize_calls(calls)["sparsity"]
    p, s = psnr(clips, context["dense"]), ssim(clips, context["dense"])
    velocity = predict_velocities(model, context["heldout"], sparse)
    faith = summarize_faithfulness(clips, context["texts"])
    return {"config": None if sparse is None else sparse.to_dict(), "sparsity": sparsity, "seconds": seconds,
            "psnr": float(p.mean()), "ssim": float(s.mean()), "psnr_per_clip": p.tolist(),
            "faithfulness": {"overall": faith["overall"], "per_attribute": faith["per_attribute"]},
            "velocity_error": velocity_error(velocity, context["reference_velocity"], context["heldout"]),
            "heldout_loss": heldout_loss(velocity, context["heldout"])}


def part_evaluate(grid: Grid) -> None:
    """The teacher, the noise floor and the training-free rules (skipping those already measured); then
    the grid so far."""
    from ..eval.faithfulness_summary import summarize_faithfulness
    from sparsevid.eval import heldout_loss
    from ..eval.noise_floor import every_tile_config

    configs = calibration_configs(grid)
    context = grid.context()
    if grid.read("reference", "dense.json") is None:
        faith = summarize_faithfulness(context["dense"], context["texts"])
        grid.write({"seconds": context["dense_seconds"],
                    "faithfulness": {k: faith[k] for k in ("overall", "per_attribute")},
                    "heldout_loss": heldout_loss(context["reference_velocity"], context["heldout"])},
                   "reference", "dense.json")
    entries = {"noise_floor": every_tile_config(),
               **{reference_name(r, t): configs[rule_label(r, t)]
                  for t in grid.args.targets for r in grid.args.rules}}
    for name, config in entries.items():
        if grid.read("reference", f"{name}.json") is not None:
            continue
        if grid.eval_seconds() > grid.seconds_left():
            print(f"evaluate: stopping before {name} ({grid.seconds_left():.0f} s left); run --part evaluate again")
            break
        grid.write(evaluate_entry(grid, grid.teacher(), config), "reference", f"{name}.json")
        print(f"evaluate: {name} done")
    write_grid(grid)


def write_grid(grid: Grid) -> None:
    """Collect every measured entry into ``grid.json`` and render ``grid.md`` (missing entries are listed), from
    the files alone (``context.json`` describes the evaluation)."""
    a = grid.args
    context = grid.read("context.json")
    if context is None:
        raise ValueError(f"{grid.path('context.json')} not found: run --part evaluate or train first")
    reference = {p.stem: json.loads(p.read_text()) for p in sorted(grid.path("reference").glob("*.json"))}
    training_free = {}
    for target in a.targets:
        for rule in a.rules:
            entry = reference.get(reference_name(rule, target))
            if entry is not None:
                training_free[student_name("training-free", rule, target)] = {
                    "objective": "training-free", "rule": rule, "target": target, **entry}
    students = {}
    for student in student_plan(a.targets, a.rules, a.objectives):
        measured = grid.read("students", student["name"], "eval.json")
        if measured is not None:
            students[student["name"]] = {**student, **measured}
    planned = [s["name"] for s in student_plan(a.targets, a.rules, a.objectives)]
    result = {"settings": {"targets": a.targets, "steps": a.steps, "batch": a.batch, "clips": a.clips, "lr": a.lr,
                           "trainable": a.trainable, "train_shift": a.train_shift, "seed": a.seed,
                           "data_seed": a.data_seed, **context,
                           **({"synthetic_sampling": synthetic_sampling(a, grid._loaded_teacher())}
                              if a.fine_tune_on == "synthetic" else {}),
                           "model": a.model or ("tiny" if a.tiny else "shipped"),
                           "calibration": grid.read("calibration.json")},
              "dense": reference.get("dense"), "noise_floor": reference.get("noise_floor"),
              "training_free": training_free, "students": students,
              "missing": [n for n in planned if n not in students]}
    grid.write(result, "grid.json")
    grid.path("grid.md").write_text(grid_markdown(result))
    plot_grid(result, grid.path("grid.png"))
    print(f"report: wrote {grid.path('grid.json')}, {grid.path('grid.md')} and {grid.path('grid.png')}"
          + (f" ({len(result['missing'])} students missing)" if result["missing"] else ""))


def part_ship(grid: Grid) -> None:
    """Copy the best student at the highest target sparsity (PSNR against dense) to ``--ship-to``."""
    from sparsevid.training import STUDENT_CONFIG, STUDENT_WEIGHTS

    if not grid.args.ship_to:
        raise ValueError("--part ship needs --ship-to DIR")
    target = max(grid.args.targets)
    plan = student_plan([target], grid.args.rules, grid.args.objectives)
    found = {s["name"]: grid.read("students", s["name"], "eval.json") for s in plan if s["rule"] is not None}
    found = {name: e for name, e in found.items() if e is not None}
    if not found:
        raise ValueError(f"no student at {target:.0%} has been trained yet")
    best = max(found, key=lambda name: found[name]["psnr"])
    destination = Path(grid.args.ship_to)
    destination.mkdir(parents=True, exist_ok=True)
    for file in (STUDENT_WEIGHTS, STUDENT_CONFIG):
        shutil.copyfile(grid.path("students", best, file), destination / file)
    print(f"ship: {best} (PSNR {found[best]['psnr']:.2f} dB against dense) -> {destination}")


def part_plan(grid: Grid) -> None:
    """Print, without touching a model, the pending work and how it packs into calls of ``--budget-minutes``
    (from the measured or estimated seconds per step; each call also spends ~``CALL_OVERHEAD_SECONDS``
    loading and sampling the teacher's reference clips)."""
    a = grid.args
    pending = pending_students(grid)
    estimates = {s["name"]: _estimate(grid, s) for s in pending}
    usable = a.budget_minutes * 60 - CALL_OVERHEAD_SECONDS
    calls, left = [], 0.0
    for name, estimate in estimates.items():
        if not calls or estimate > left:
            calls.append([])
            left = usable
        calls[-1].append(f"{name} ~{estimate:.0f}s")
        left -= estimate
    source = "measured" if grid.read("timing.json") else "H200 estimates"
    print(f"plan: {len(pending)} students pending ({source}: {a.steps} steps x batch {a.batch}); "
          f"{sum(estimates.values()) / 60:.1f} min of training and evaluation in "
          f"{len(calls)} train call(s) of {a.budget_minutes} min")
    for number, names in enumerate(calls, 1):
        print(f"  train call {number}: {', '.join(names)}")
    entries = 1 + len(a.targets) * len(a.rules)
    print(f"  evaluate: {entries} entries (noise floor, training-free rules) "
          f"~{entries * grid.eval_seconds() / 60:.1f} min")


def synthetic_sampling(a: argparse.Namespace, teacher) -> dict:
    """{"steps", "guidance"} of the teacher samples ``--part cache`` draws: ``--cache-steps`` /
    ``--cache-guidance``, by default the evaluation's sampler (``--sample-steps`` / ``--guidance``, else the
    teacher's own)."""
    sampling = teacher.config["sampling"]
    steps = next(v for v in (a.cache_steps, a.sample_steps, sampling["steps"]) if v is not None)
    guidance = next(v for v in (a.cache_guidance, a.guidance, sampling["guidance"]) if v is not None)
    return {"steps": steps, "guidance": guidance}


def part_cache(grid: Grid) -> None:
    """``--fine-tune-on synthetic``: sample the teacher densely for the captions of the slice arm's ``--clips``
    fine-tuning clips (same data seed) into OUT/synthetic, with ``sparsevid.data.cache_synthetic`` (resumable: a
    call continues the clips the last one did not reach)."""
    from sparsevid.data import cache_synthetic

    from ..data.sources import ProceduralSource
    from ..model.pipeline import builtin_encoder

    a = grid.args
    if a.fine_tune_on != "synthetic":
        raise ValueError("--part cache makes the data of --fine-tune-on synthetic")
    teacher = grid.teacher()
    captions = ProceduralSource(grid.data_slice(teacher), seed=a.data_seed, clips=a.clips).captions(range(a.clips))
    frames, height, width = teacher.clip_shape[1:]
    sampling = synthetic_sampling(a, teacher)
    report = cache_synthetic(builtin_encoder(teacher), captions, a.clips, grid.path("synthetic"), height, width,
                             frames, steps=sampling["steps"], guidance=sampling["guidance"], seed=a.data_seed,
                             batch_size=a.cache_batch)
    print(f"cache: {report.written} clips sampled in {report.seconds:.0f} s ({report.clips_per_second:.2f} clips/s); "
          f"{report.total} of {a.clips} in {grid.path('synthetic')}")


PARTS = {"plan": part_plan, "cache": part_cache, "calibrate": part_calibrate, "train": part_train, "evaluate": part_evaluate,
         "report": write_grid, "ship": part_ship}


def _words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    from ..cli.args import clip_arg

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="the grid's folder (resumed across calls)")
    p.add_argument("--part", nargs="+", required=True, choices=tuple(PARTS), help="parts to run, in order")
    p.add_argument("--targets", type=float, nargs="+", default=[0.63, 0.95],
                   help="target sparsities (default: the second-generation model's Wan-equivalent operating point, "
                        "where its oracle recall is 0.85, and 0.95)")
    p.add_argument("--rules", nargs="+", choices=GRID_RULES, default=list(RULES),
                   help="mask rules of the grid (the claims need the three global ones; fewer for a quick run); "
                        f"'{PER_HEAD}': the per-head calibrated plan (SparseConfig.from_calibration) at the sparsity "
                        "global top-k reaches")
    p.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES),
                   help="training objectives of the students (claim 3 and the dense control need diffusion)")
    p.add_argument("--budget-minutes", type=float, default=8.5, help="wall-clock budget of this call")
    p.add_argument("--model", default=None, help="the dense teacher's directory (default: the shipped model)")
    p.add_argument("--tiny", action="store_true", help="an untrained tiny teacher instead (CPU smoke run)")
    p.add_argument("--clip", type=clip_arg, default=None, help="T,H,W clip shape (default: the teacher's own)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=200, help="training steps of every student")
    p.add_argument("--batch", type=int, default=8, help="clips per step of every student")
    p.add_argument("--clips", type=int, default=1024, help="distinct fine-tuning clips of every student")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--trainable", default="attention", choices=("attention", "all"))
    p.add_argument("--train-shift", type=float, default=None,
                   help="time shift of the students' training noise levels (default: the teacher's pre-training "
                        "shift; recorded in grid.json's settings as null then)")
    p.add_argument("--seed", type=int, default=0, help="noise seed of training")
    p.add_argument("--data-seed", type=int, default=1, help="seed of the fine-tuning clips")
    p.add_argument("--fine-tune-on", choices=("slice", "full", "synthetic"), default="slice",
                   help="the students' data: the slice below (unlike pre-training), the model's whole "
                        "distribution (like pre-training), or the teacher's own samples of the slice's captions "
                        "(made by --part cache); the evaluation stays outside the slice either way")
    p.add_argument("--cache-batch", type=int, default=8, help="--part cache: clips sampled per call")
    p.add_argument("--cache-steps", type=int, default=None,
                   help="--part cache: sampler steps of the teacher samples (default: the evaluation's)")
    p.add_argument("--cache-guidance", type=float, default=None,
                   help="--part cache: guidance scale of the teacher samples (default: the evaluation's)")
    p.add_argument("--max-objects", type=int, default=1, help="fine-tuning slice: objects per clip at most")
    p.add_argument("--backgrounds", type=_words, default=["navy"], help="fine-tuning slice: backgrounds")
    p.add_argument("--colours", type=_words, default=None, help="fine-tuning slice: colours (default: all)")
    p.add_argument("--motions", type=_words, default=["moving left", "moving right"],
                   help="fine-tuning slice: motions")
    p.add_argument("--captions", type=int, default=8, help="held-out captions (outside the slice)")
    p.add_argument("--caption-seed", type=int, default=0, help="seed that draws the held-out captions")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="noise seeds of the evaluation clips")
    p.add_argument("--sample-steps", type=int, default=None, help="sampler steps (default: the teacher's)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the teacher's)")
    p.add_argument("--heldout-per-bin", type=int, default=8, help="held-out triples per noise-level bin")
    p.add_argument("--noise-bins", type=int, default=5)
    p.add_argument("--ship-to", default=None, help="asset folder for --part ship")
    args = p.parse_args(argv)
    args.started = time.time()
    if args.tiny:
        args.model = None
    if not args.targets or any(not 0 < t < 1 for t in args.targets):
        p.error(f"--targets must be sparsities in (0, 1), got {args.targets}")
    if args.train_shift is not None and not args.train_shift > 0:
        p.error(f"--train-shift must be positive, got {args.train_shift}")
    if args.cache_steps is not None and args.cache_steps < 1:
        p.error(f"--cache-steps must be >= 1, got {args.cache_steps}")
    if args.cache_guidance is not None and not args.cache_guidance >= 0:
        p.error(f"--cache-guidance must be >= 0, got {args.cache_guidance}")
    for name in ("steps", "batch", "clips", "captions", "cache_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    grid = Grid(args)
    for part in args.part:
        PARTS[part](grid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
