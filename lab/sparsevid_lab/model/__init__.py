"""The built-in video DiT (a diffusers Wan transformer in pixel space with a caption encoder), its sampler and its
sparse students."""
