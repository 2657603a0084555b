"""The demo command end to end on the tiny configuration."""
import json

import pytest

from sparsevid.cli import main


def test_demo_runs_and_writes_its_files(tmp_path, capsys):
    assert main(["demo", "--tiny", "--out", str(tmp_path), "--steps", "2", "--rule", "topk", "--topk", "0.25"]) == 0
    printed = capsys.readouterr().out
    assert "sparsity" in printed and "PSNR" in printed and "SSIM" in printed
    for name in ("dense_vs_sparse.gif", "dense_vs_sparse.png", "demo.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["sparse"]["sparsity"] == pytest.approx(0.75)  # one of four key blocks per query block
    assert summary["settings"]["steps"] == 2


def test_eval_command_writes_table_and_json(tmp_path):
    assert main(["eval", "--tiny", "--out", str(tmp_path), "--steps", "2", "--captions", "1",
                 "--config", "rule=topk,topk=1,tile=none", "--config", "rule=topk,topk=1.0"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["configs"]) == {"rule=topk,topk=1,tile=none", "rule=topk,topk=1.0"}
    assert results["configs"]["rule=topk,topk=1.0"]["sparsity"] == 0.0
    assert "| config | sparsity |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "first_clip.gif").is_file()


def test_demo_rejects_bad_sparse_settings(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--tiny", "--out", str(tmp_path), "--topp", "1.5"])
    assert exit_info.value.code == 2 and "--topp" in capsys.readouterr().err
