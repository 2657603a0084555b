"""The end-to-end transformer benchmark on the CPU: every sparse setting at every requested precision."""
import json

import pytest

from benchmarks.bench_e2e import main as run_e2e

TINY = ["--device", "cpu", "--dtype", "float32", "--layers", "1", "--grid", "2x4x4", "--heads", "2",
        "--models", "wan1.3b", "--warmup", "0", "--iters", "1", "--sparsity", "0.5", "--backend", "reference"]


def test_each_sparse_setting_runs_at_each_precision(tmp_path):
    run_e2e(["--out", str(tmp_path), *TINY, "--precision", "native,int8"])
    (result,) = tmp_path.glob("*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [(r["setting"], r["config"].get("precision", "native")) for r in rows] == [
        ("dense", "native"), ("sparse 50%", "native"), ("sparse 50% int8", "int8")]
    assert all(r["forward_ms"] > 0 and r["speedup_forward"] > 0 for r in rows)


def test_unknown_precision_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_e2e(["--out", str(tmp_path), *TINY, "--precision", "int4"])
    assert "--precision" in capsys.readouterr().err
