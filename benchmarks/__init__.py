"""GPU benchmarks of sparsevid and the helpers they share (run each from the repository root as
``python -m benchmarks.<name> --help``; ``benchmarks/gpu_session.sh`` runs them in bounded parts)."""
