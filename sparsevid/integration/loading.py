"""Loading a diffusers video transformer by path or hub id, on its own or from a pipeline's folder."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .adapters import adapter_for


def load_transformer(source: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """The diffusers video transformer at ``source``: a transformer folder (its ``config.json`` names the class),
    a pipeline folder (its ``transformer`` subfolder) or a hub id of either (``from_pretrained``, which reads the
    local cache or downloads), its floating weights in ``dtype`` except the modules diffusers keeps in float32 for
    this class. TypeError when it is no video transformer sparsevid supports."""
    import diffusers

    path = Path(source)
    subfolder = None
    if path.is_dir():
        if (path / "model_index.json").is_file():
            path, subfolder = path / "transformer", None
        config = path / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{source}: neither a transformer folder (config.json) nor a pipeline folder "
                                    f"(model_index.json)")
        class_name = json.loads(config.read_text()).get("_class_name")
    else:
        class_name, subfolder = _hub_class(str(source))
    model_class = getattr(diffusers, str(class_name), None)
    if model_class is None:
        raise TypeError(f"{source}: diffusers has no model class {class_name!r}")
    transformer = model_class.from_pretrained(str(path if path.is_dir() else source), subfolder=subfolder,
                                              torch_dtype=dtype)
    adapter_for(transformer)  # TypeError for an unsupported family
    return transformer.to(device)


def _hub_class(repo: str) -> tuple[str, str | None]:
    """(class name, subfolder) of a hub id: a pipeline's transformer or a transformer repository."""
    from huggingface_hub import hf_hub_download

    try:
        index = json.loads(Path(hf_hub_download(repo, "model_index.json")).read_text())
        return index["transformer"][1], "transformer"
    except (OSError, KeyError, ValueError):  # not a pipeline repository: a transformer one
        config = json.loads(Path(hf_hub_download(repo, "config.json")).read_text())
        return config["_class_name"], None
