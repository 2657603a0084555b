"""``python -m sparsevid_lab demo``: the built-in video DiT generates one clip densely and under a sparse attention setting;
prints the wall and attention time of each run, the speed-ups, the sparsity and the similarity to the dense
clip, and writes the clips side by side (GIF + PNG strip of every other frame): each column labelled with its
setting, the share of attention tiles it skipped and its PSNR / SSIM against the dense clip, each row with its
frame, and the caption and the noise floor above."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from sparsevid.cli.args import CommandError, default_device, device_arg, fraction_arg, positive_int_arg, topk_arg

from .args import check_caption_fits, check_caption_words, clip_arg, model_dir_arg, student_dir_arg

DEFAULT_CAPTION = "big green striped square moving left and small magenta plain circle moving up on a beige background"
DENSE, STUDENT, NOISE_FLOOR = "dense", "sparse student", "noise floor"
AUTO, NONE = "auto", "none"  # --student: the shipped student if there is one; no student
# The default training-free setting, chosen from measured demo runs on a 2-core CPU (docs/builtin_model.md,
# "Demo"): top-k 0.25 (75% sparsity) ran 1.8x faster than dense; hybrid 0.05 / 0.9 (45%) was no faster.
DEFAULT_RULE, DEFAULT_TOPK, DEFAULT_TOPP = "topk", 0.25, 0.9
# --noise-floor auto measures the noise floor (one more generation as long as the dense one) when the dense
# generation took at most this long (a GPU); otherwise it reuses a matching earlier run's or says it skipped it.
AUTO_NOISE_FLOOR_S = 20.0
MEANING = ("What the numbers mean: wall s is the whole generation, attention s its self-attention calls (mask "
           "prediction included), speed-up dense time / this run's time (above 1 = faster), sparsity the share of "
           "attention tiles skipped; PSNR / SSIM say how close a clip is to the dense clip of the same noise "
           "(higher = closer, SSIM 1 = identical) and the noise floor is how close dense gets to itself through the "
           "block-sparse path with every tile kept (rounding differences only: no sparse setting can be expected "
           "above it); faithful is how well a clip shows its caption, read back from the pixels "
           "(0 to 1).")


def add_parser(subparsers) -> None:
    summary = ("Generate one clip with dense attention, with a training-free sparse setting and with a distilled "
               "sparse student (the shipped one, or --student); print the time, the sparsity, how close each clip is to the dense "
               "one next to the noise floor, and write the clips side by side, labelled (GIF and PNG).")
    p = subparsers.add_parser("demo", description=summary,
                              help="Generate a clip with dense and with sparse attention and compare them.")
    p.add_argument("--caption", default=DEFAULT_CAPTION,
                   help="what the clip shows, in the built-in caption grammar: '<size> <colour> <texture> <shape> "
                        "<motion> [and <object>...] on a <background> background'")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    p.add_argument("--steps", type=positive_int_arg, default=None,
                   help="sampler steps (without it: the model's own, 10 for the shipped model)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale (without it: the model's own)")
    p.add_argument("--rule", default=DEFAULT_RULE, choices=("topk", "topp", "hybrid"),
                   help="how each row of attention tiles is chosen: the top-k blocks, the blocks holding top-p "
                        "of the pooled attention mass, or the union of both")
    p.add_argument("--topk", type=topk_arg, default=DEFAULT_TOPK,
                   help="key blocks kept per query block: a fraction in (0, 1] such as 0.05, or a whole count "
                        "such as 2")
    p.add_argument("--topp", type=fraction_arg, default=DEFAULT_TOPP,
                   help="share of each row's pooled attention mass to keep, in (0, 1]")
    p.add_argument("--clip", type=clip_arg, default=None, metavar="T,H,W",
                   help="clip frames, height, width (default: the model's own)")
    p.add_argument("--model", type=model_dir_arg, default=None,
                   help="directory with builtin.safetensors and builtin.json, as `python -m sparsevid_lab train` or "
                        "`python -m sparsevid_lab distill` write (without it: the shipped model)")
    p.add_argument("--student", type=student_arg, default=AUTO, metavar="DIR",
                   help="a sparse student for the third clip, sampled with its own sparse setting: a student folder "
                        "(student.json and student.safetensors, fine-tuned from the --model weights, as `python -m "
                        "sparsevid_lab distill` writes them); 'auto' (default): the student shipped beside the "
                        "model's weights (its sparse_student folder) if there is one; 'none': no student column")
    p.add_argument("--noise-floor", choices=("auto", "on", "off"), default="auto",
                   help="measure the noise floor (dense through the block-sparse path with every tile kept; one more "
                        "generation as long as the dense one): on, off, or auto: measured when the dense generation "
                        f"took at most {AUTO_NOISE_FLOOR_S:.0f} s, else reused from a matching earlier run's "
                        "demo.json in --out, else skipped (and said so)")
    p.add_argument("--tiny", action="store_true", help="use an untrained tiny model instead (a quick smoke test)")
    p.add_argument("--device", type=device_arg, default=default_device(),
                   help="where to run: cpu, cuda or cuda:N")
    p.add_argument("--out", default="outputs/demo", help="output directory")
    p.set_defaults(func=run)


def load_study_model(args) -> tuple:
    """(model, its device, sampler steps: ``--steps`` or the model's, {"block_q", "block_k"}) of a study's arguments
    (``cli.args.add_study_model_options``)."""
    model = load_model(args)
    steps = args.steps or model.config["sampling"]["steps"]
    return model, next(model.parameters()).device, steps, {"block_q": args.block_q, "block_k": args.block_k}


def load_model(args):
    """The model named by ``--model`` / ``--tiny`` (shipped weights by default), on ``--device``, making clips of
    ``--clip`` (default: the model's own shape; on the CPU its CPU defaults, see
    :meth:`BuiltinVideoDiT.use_cpu_defaults`). GPUs run it in bf16 (sparse attention then uses the Triton
    kernels), the CPU in fp32 (the gather backend)."""
    from ..model.builtin import BuiltinVideoDiT, load_builtin, tiny_config

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        torch.manual_seed(0)
        model = BuiltinVideoDiT(tiny_config()).to(device, dtype).eval()
    else:
        model = load_builtin(args.model, device=device, dtype=dtype)
    if device.type == "cpu":
        own = "x".join(map(str, model.clip_shape[1:])), model.config["sampling"]["steps"]
        # an explicit --clip or --steps wins over the CPU default
        changed = model.use_cpu_defaults(clip=args.clip is None, steps=getattr(args, "steps", None) is None)
        if changed:
            print("on the CPU the model runs its CPU defaults: " + ", ".join(
                f"{k} {'x'.join(map(str, v)) if k == 'clip' else v}" for k, v in changed.items())
                  + f" (its own: clip {own[0]}, {own[1]} steps)")
    if args.clip is not None:
        try:
            model.use_clip(*args.clip)
        except ValueError as error:
            raise CommandError(f"--clip: {error}") from None
    return model


def student_arg(text: str) -> str:
    """``--student``: 'auto', 'none' or a student directory (:func:`student_dir_arg`)."""
    return text if text in (AUTO, NONE) else student_dir_arg(text)


def student_dir(args) -> str | None:
    """The student directory the demo runs: ``--student`` resolved ('auto': the shipped student beside the
    model's weights, none for --tiny), or None for no student column."""
    from .students import shipped_student

    if args.student == NONE:
        return None
    if args.student == AUTO:
        found = shipped_student(args)
        return None if found is None else str(found)
    return args.student


def read_student(directory: str, like):
    """The sparse student in ``directory`` on the device and in the dtype of ``like`` (the dense model), making
    clips of its shape. Returns (model, SparseConfig)."""
    from .students import read_student_like

    try:
        return read_student_like(directory, like)
    except ValueError as error:
        raise CommandError(f"--student: {error}") from None


def setting_name(config) -> str:
    """A short name of a training-free setting, e.g. "top-k 0.25" or "hybrid 0.05 / 0.9"."""
    return {"topk": f"top-k {config.topk:g}", "topp": f"top-p {config.topp:g}",
            "hybrid": f"hybrid {config.topk:g} / {config.topp:g}"}[config.rule]


def demo_settings(args, model, steps: int, student: str | None) -> dict:
    """{label: (model, SparseConfig)} of the clips to compare, dense first, then the training-free setting and
    the student in directory ``student`` (None: no student column). "dense" runs every step dense through the
    sparse processors (the unmodified model's computation), so its attention is timed like the sparse runs'."""
    from sparsevid.plan import SparseConfig

    sparse = SparseConfig(rule=args.rule, topk=args.topk, topp=args.topp)
    settings = {DENSE: (model, SparseConfig(dense_steps=steps)),
                f"training-free {setting_name(sparse)}": (model, sparse)}
    if student is not None:
        settings[STUDENT] = read_student(student, model)
    return settings


def sample_run(model, config, caption: str, seed: int, steps: int, guidance: float | None, label: str) -> dict:
    """One clip under ``config`` with a per-step progress bar: the clip float32 [1, 3, T, H, W], wall and
    attention seconds, mean sparsity."""
    from ..eval.harness import sample_with_stats, summarize_calls

    clips, seconds, calls = sample_with_stats(model, config, [(caption, seed)], steps, guidance, progress=label)
    return {"config": config.to_dict(), "seconds": seconds, **summarize_calls(calls), "clip": clips}


def compare_runs(runs: dict, caption: str) -> None:
    """Adds to every run its speed-ups, PSNR / SSIM against the dense clip and its caption faithfulness
    (``sparsevid_lab.eval.faithfulness``, overall in [0, 1]); the clips become [3, T, H, W]."""
    from ..eval.faithfulness import faithfulness
    from sparsevid.eval.video_metrics import psnr, ssim

    dense = runs[DENSE]
    for r in runs.values():
        r["speedup"] = dense["seconds"] / r["seconds"]
        r["attention_speedup"] = dense["attention_s"] / r["attention_s"]
        r["psnr"], r["ssim"] = float(psnr(r["clip"], dense["clip"])[0]), float(ssim(r["clip"], dense["clip"])[0])
        r["faithfulness"] = faithfulness(r["clip"].float(), [caption])[0]["overall"]
    for r in runs.values():
        r["clip"] = r["clip"][0]


def run_settings(settings: dict, caption: str, seed: int, steps: int, guidance: float | None,
                 noise_floor: str = "off") -> dict:
    """Sample the caption once per setting ({label: (model, config)}, dense first), after a one-step warm-up,
    and with ``noise_floor`` "on" (or "auto" when the dense generation took at most ``AUTO_NOISE_FLOOR_S``)
    once more with the dense model through the block-sparse path with every tile kept, as :data:`NOISE_FLOOR`.
    Returns {label: run} (see :func:`sample_run`, :func:`compare_runs`)."""
    from ..eval.harness import sample_with_stats
    from ..eval.noise_floor import every_tile_config

    warm_up_model, warm_up_config = list(settings.values())[1]
    sample_with_stats(warm_up_model, warm_up_config, [(caption, seed)], 1, guidance)  # first calls are slow
    runs = {label: sample_run(model, config, caption, seed, steps, guidance, label)
            for label, (model, config) in settings.items()}
    if noise_floor == "on" or (noise_floor == "auto" and runs[DENSE]["seconds"] <= AUTO_NOISE_FLOOR_S):
        runs[NOISE_FLOOR] = sample_run(settings[DENSE][0], every_tile_config(), caption, seed, steps, guidance,
                                       NOISE_FLOOR)
    compare_runs(runs, caption)
    return runs


def model_record(args, model) -> dict:
    """Which model a command sampled and how: its name (``--tiny``, ``--model`` or the shipped one), clip shape,
    device type and dtype (as results record them)."""
    parameter = next(model.parameters())
    return {"model": "tiny" if args.tiny else str(args.model or "shipped"), "clip": list(model.clip_shape[1:]),
            "device": parameter.device.type, "dtype": str(parameter.dtype).removeprefix("torch.")}


def run_key(args, steps: int, model) -> dict:
    """What makes two demo runs' noise floors comparable: model, clip, caption, seed, steps, guidance, device."""
    record = model_record(args, model)
    return {"model": record["model"], "clip": record["clip"], "caption": args.caption, "seed": args.seed,
            "steps": steps, "guidance": args.guidance, "device": record["device"], "dtype": record["dtype"],
            "threads": torch.get_num_threads()}


def earlier_noise_floor(summary_path: Path, key: dict) -> dict | None:
    """The noise floor measured by an earlier demo run written to ``summary_path`` with the same ``key``
    (with its "measured_at"), or None."""
    try:
        earlier = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return None
    row = earlier.get("runs", {}).get(NOISE_FLOOR)
    if earlier.get("key") != key or row is None:
        return None
    return {**row, "measured_at": row.get("measured_at", earlier.get("finished"))}


def print_table(runs: dict) -> None:
    print(f"{'setting':<30} {'wall s':>7} {'attention s':>11} {'speed-up wall / attention':>26} "
          f"{'sparsity':>8} {'PSNR dB':>8} {'SSIM':>7} {'faithful':>8}")
    for label, r in runs.items():
        speedup = f"{r['speedup']:.2f}x / {r['attention_speedup']:.2f}x"
        print(f"{label:<30} {r['seconds']:7.1f} {r['attention_s']:11.1f} {speedup:>26} {r['sparsity']:8.1%} "
              f"{r['psnr']:8.2f} {r['ssim']:7.4f} {r['faithfulness']:8.2f}")


def noise_floor_line(runs: dict, floor: dict | None, reused: bool) -> str:
    """One line: the noise floor next to the sparse clips' PSNR / SSIM, or why it is missing."""
    sparse = ", ".join(f"{label} {r['psnr']:.2f} dB / {r['ssim']:.4f}" for label, r in runs.items()
                       if label not in (DENSE, NOISE_FLOOR))
    if floor is None:
        return (f"PSNR / SSIM vs dense: {sparse}; noise floor not measured in this run (it costs one more "
                f"generation as long as the dense one, {runs[DENSE]['seconds']:.0f} s here): --noise-floor on "
                f"measures it, later runs into the same --out reuse it")
    source = f"reused from the run of {floor['measured_at']}" if reused else "measured in this run"
    return (f"PSNR / SSIM vs dense: {sparse}; noise floor {floor['psnr']:.2f} dB / {floor['ssim']:.4f} "
            f"(dense through the block-sparse path with every tile kept, {source})")


def clip_label(label: str, run: dict) -> str:
    """The label over a clip in the picture (lines apart by newlines): what the clip is, the share of attention
    tiles it skipped and, for a sparse clip, its PSNR / SSIM against the dense clip."""
    if label == DENSE:
        return "dense (all tiles)\nthe reference"
    return (f"{label}\n{run['sparsity']:.0%} of attention tiles skipped\n"
            f"PSNR {run['psnr']:.2f} dB, SSIM {run['ssim']:.4f}")


def picture_note(floor: dict | None) -> str:
    """The header line of the picture that says what the numbers under the labels are, with the noise floor
    (or that this run did not measure it)."""
    if floor is None:
        return "PSNR / SSIM vs the dense clip (higher = closer); noise floor not measured"
    return (f"PSNR / SSIM vs the dense clip (higher = closer); noise floor {floor['psnr']:.2f} dB / "
            f"{floor['ssim']:.4f} = dense through the sparse path with every tile kept")


def run(args) -> int:
    from ..eval.media import write_clips

    check_caption_words(args.caption)
    start = time.perf_counter()
    model = load_model(args)
    check_caption_fits(model, args.caption)
    steps = args.steps or model.config["sampling"]["steps"]
    student = student_dir(args)
    settings = demo_settings(args, model, steps, student)
    patch = model.transformer.config.patch_size
    grid = [s // p for s, p in zip(model.clip_shape[1:], patch)]
    device = next(model.parameters()).device
    backend = "Triton kernels" if device.type == "cuda" else "gather backend (kept tiles only)"
    print(f"built-in video DiT: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{grid[0]}x{grid[1]}x{grid[2]} = {grid[0] * grid[1] * grid[2]} tokens per clip, "
          f"device {args.device} ({next(model.parameters()).dtype}, {torch.get_num_threads()} threads), "
          f"sparse attention by the {backend}; loaded in {time.perf_counter() - start:.1f}s")
    print(f"caption: {args.caption!r}, seed {args.seed}, {steps} steps")
    out = Path(args.out)
    key = run_key(args, steps, model)
    runs = run_settings(settings, args.caption, args.seed, steps, args.guidance, args.noise_floor)
    finished = time.strftime("%Y-%m-%d %H:%M:%S")
    floor, reused = runs.get(NOISE_FLOOR), False
    if floor is not None:
        floor["measured_at"] = finished
    if floor is None and args.noise_floor == "auto":
        floor = earlier_noise_floor(out / "demo.json", key)
        reused = floor is not None
    print_table(runs)
    print(noise_floor_line(runs, floor, reused))
    print(MEANING)
    clips = {label: r for label, r in runs.items() if label != NOISE_FLOOR}
    paths = write_clips([r["clip"] for r in clips.values()], out / "dense_vs_sparse",
                        labels=[clip_label(label, r) for label, r in clips.items()],
                        caption=f'caption: "{args.caption}"', note=picture_note(floor), frame_labels=True)
    rows = {label: {k: v for k, v in r.items() if k != "clip"} for label, r in runs.items()}
    if reused:
        rows[NOISE_FLOOR] = floor
    summary = {"caption": args.caption, "seed": args.seed, "key": key, "finished": finished,
               "settings": {"steps": steps, "guidance": args.guidance or model.config["sampling"]["guidance"],
                            "device": str(device), "threads": torch.get_num_threads(),
                            "student": student, "noise_floor": args.noise_floor},
               "runs": rows}
    (out / "demo.json").write_text(json.dumps(summary, indent=2))
    print("wrote " + ", ".join(str(p) for p in paths + [out / "demo.json"]))
    print(f"total {time.perf_counter() - start:.1f}s")
    return 0
