"""Speed benchmarks of sparsevid against dense and sparse baselines, and the helpers they share. Run one from the
repository root by its registered name, ``python -m benchmarks NAME`` (``--list`` names them; ``registry.py``);
each writes its current result to ``benchmarks/results/NAME/<gpu>.{json,md,png}``. ``gpu_session.sh`` runs
them in parts bounded to a few GPU minutes; ``NOTES.md`` keeps the history of the measured changes."""
