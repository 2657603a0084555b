"""sparsevid's lab: the built-in video DiT (a small diffusers Wan transformer with a caption encoder, trained on
procedural clips whose ground truth is known), its data, the caption-faithfulness scorer, the demo and the
studies that measure sparse attention against dense on it. Not part of the sparsevid wheel; it uses only the
library's public API, as any user would."""
