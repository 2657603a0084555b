"""``sparsevid evaluate``: a sparse setting or a student against the dense transformer, on held-out latents."""
from __future__ import annotations

import json
from pathlib import Path

from .args import (CommandError, add_noise_range_option, config_spec_arg, default_device, device_arg,
                   positive_int_arg)
from .distill import heldout_triples


def add_parser(subparsers) -> None:
    summary = ("Measure sparse attention against the dense transformer without sampling: the relative error of the "
               "predicted velocity and the flow-matching loss on fixed held-out (latents, noise, noise level) "
               "triples, per noise-level bin; for a training-free setting (--sparse) or a student (--student).")
    p = subparsers.add_parser("evaluate", description=summary, help="Velocity error of sparse attention vs dense.")
    p.add_argument("--model", required=True,
                   help="the dense transformer: a transformer or pipeline folder, or a hub id")
    p.add_argument("--data", required=True, help="folder of held-out latent samples (sparsevid.training.latents)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--sparse", type=config_spec_arg, help="a training-free setting: 'key=value,...' or JSON file")
    what.add_argument("--student", help="a student folder written by `sparsevid distill`")
    p.add_argument("--per-bin", type=positive_int_arg, default=4, help="triples per noise-level bin")
    p.add_argument("--bins", type=positive_int_arg, default=5, help="noise-level bins")
    add_noise_range_option(p, "the noise levels t the triples span (default 0,1; one expert's, e.g. 0,0.875)")
    p.add_argument("--device", type=device_arg, default=default_device(), help="cpu, cuda or cuda:N")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..eval import heldout_loss, predict_velocities, velocity_error
    from ..integration import load_transformer
    from ..plan import parse_config
    from ..training import LatentDirectory, load_student

    dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    try:
        data = LatentDirectory(args.data)
        heldout = heldout_triples(data, args.per_bin, args.bins, args.noise_range)
        transformer = load_transformer(args.model, dtype=dtype, device=args.device).eval()
        dense = predict_velocities(transformer, heldout)
        if args.student is not None:
            load_student(transformer, args.student)
            sparse = predict_velocities(transformer, heldout)
        else:
            sparse = predict_velocities(transformer, heldout, parse_config(args.sparse))
    except (FileNotFoundError, TypeError, ValueError) as error:
        raise CommandError(str(error)) from None
    result = {"velocity_error": velocity_error(sparse, dense, heldout),
              "heldout_loss": {"dense": heldout_loss(dense, heldout), "sparse": heldout_loss(sparse, heldout)},
              "heldout": heldout.describe()}
    print(f"velocity error against dense: {result['velocity_error']['overall']:.4f} "
          f"(per bin {', '.join(f'{v:.4f}' for v in result['velocity_error']['per_bin'])})")
    print(f"held-out flow-matching loss: dense {result['heldout_loss']['dense']['overall']:.4f}, "
          f"sparse {result['heldout_loss']['sparse']['overall']:.4f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0
