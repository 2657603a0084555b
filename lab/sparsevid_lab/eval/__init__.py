"""The built-in model's yardsticks: caption faithfulness read from the pixels, the sampling harness and suite, the
noise floor, students against the dense model, attention recorded during generation, clips as GIF/PNG."""
