"""The README's "Using it" snippets run as written (each Python block, in order, in one namespace)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def using_it_blocks() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Using it"):text.index("## Measured")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_using_it_section_has_the_op_the_one_line_switch_and_the_training_free_setting():
    blocks = using_it_blocks()
    assert len(blocks) == 3
    assert "sv.block_sparse_attention" in blocks[0] and "sv.apply_sparse_attention(transformer" in blocks[1]


def test_the_snippets_run_as_written(capsys):
    pytest.importorskip("diffusers")
    namespace = {}
    for block in using_it_blocks():
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    assert "of the attention tiles skipped" in capsys.readouterr().out
    assert namespace["velocity"].shape == namespace["latents"].shape
    assert not namespace["sv"].is_sparse(namespace["transformer"])  # removed again at the end
    assert namespace["cfg"].schedule == "snr"
