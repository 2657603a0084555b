"""Studies on the built-in model, each run as ``python -m sparsevid_lab.studies.<name>``: the claims grid and its
report, the motion study, the builtin study, training-free quality, faithfulness validation, the hybrid split, the
built-in quality table, the data-parallel comparison and the per-head calibration against global rules
(per_head_calibration). Results live in ``lab/results/``."""
