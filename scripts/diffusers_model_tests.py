"""Run diffusers' own transformer tests of sparsevid's families, stock and with sparse attention at full density.

    python scripts/diffusers_model_tests.py DIFFUSERS_CHECKOUT [FAMILY ...] [--pytest-args "-k output"]

For each family (default: every adapter whose test file exists in the checkout), the test file
``tests/models/transformers/test_models_transformer_<family>.py`` of a diffusers source checkout runs twice under
pytest with the installed diffusers: stock, then with this file as a plugin (``-p diffusers_model_tests``) that
applies ``sparsevid.apply_sparse_attention(model, SparseConfig(rule="topk", topk=1.0))`` to every instance of the
family's transformer class right after construction (every tile kept: outputs equal the stock model's up to float
rounding). It prints each run's counts and the tests whose outcome differs. The checkout is only read.
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

MODE_VARIABLE = "SPARSEVID_DIFFUSERS_TESTS"
TEST_DIR = Path("tests/models/transformers")
# Families whose diffusers test file is not named after the family.
TEST_FILES = {"hunyuan_video15": "hunyuan_1_5"}


def _make_sparse_on_construction(cls) -> None:
    """Wrap ``cls.__init__`` and ``cls.from_pretrained``: an instance of ``cls`` itself gets sparse attention at full
    density once it is built (``from_pretrained`` builds it on the meta device first: that one after loading)."""
    import sparsevid as sv

    def make_sparse(model) -> None:
        if type(model) is cls and not any(p.is_meta for p in model.parameters()):
            sv.apply_sparse_attention(model, sv.SparseConfig(rule="topk", topk=1.0))

    init, load = cls.__init__, cls.from_pretrained.__func__

    @functools.wraps(init)  # diffusers reads the config's fields from __init__'s signature
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        make_sparse(self)

    @functools.wraps(load)
    def from_pretrained(klass, *args, **kwargs):
        model = load(klass, *args, **kwargs)
        make_sparse(model)
        return model

    cls.__init__, cls.from_pretrained = __init__, classmethod(from_pretrained)


def pytest_configure(config) -> None:
    """pytest hook (this module as a plugin): make every supported transformer class sparse at construction."""
    if os.environ.get(MODE_VARIABLE) != "sparse":
        return
    import diffusers

    from sparsevid.integration.adapters import ADAPTERS

    for adapter in ADAPTERS:
        cls = getattr(diffusers, adapter.class_name, None)
        if cls is not None:
            _make_sparse_on_construction(cls)


def family_test_file(checkout: Path, family: str) -> Path:
    """The diffusers test file of ``family`` in ``checkout``."""
    return checkout / TEST_DIR / f"test_models_transformer_{TEST_FILES.get(family, family)}.py"


def run(checkout: Path, family: str, mode: str, pytest_args: list[str]) -> dict[str, str] | None:
    """{test id: outcome} of ``family``'s diffusers test file run in ``mode`` ("stock" or "sparse"); None (and a
    message) when pytest ended without a report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        env = {**os.environ, MODE_VARIABLE: mode,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "pytest", str(family_test_file(checkout, family)), "-q",
                   "-p", "no:cacheprovider", "-p", "diffusers_model_tests", f"--junitxml={report}", *pytest_args]
        done = subprocess.run(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              check=False)
        if not report.exists():
            print(f"{family} ({mode}): pytest ended with code {done.returncode} and no report: {' '.join(command)}")
            return None
        return _outcomes(ET.parse(report).getroot())


def _outcomes(root: ET.Element) -> dict[str, str]:
    outcomes = {}
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = next((kind for kind in ("failure", "error", "skipped") if kind in kinds), "passed")
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a diffusers source checkout (its tests/ directory is used)")
    parser.add_argument("families", nargs="*", help="sparsevid family names (default: all with a test file)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    args = parser.parse_args(argv)
    from sparsevid.integration.adapters import ADAPTERS

    known = [adapter.name for adapter in ADAPTERS]
    unknown = sorted(set(args.families) - set(known))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {known}")
    if not (args.checkout / TEST_DIR).is_dir():
        parser.error(f"{args.checkout} has no {TEST_DIR}: give a diffusers source checkout")
    families = args.families or [name for name in known if family_test_file(args.checkout, name).exists()]
    differs = False
    for family in families:
        if not family_test_file(args.checkout, family).exists():
            print(f"{family}: no test file {family_test_file(args.checkout, family)}")
            continue
        results = {mode: run(args.checkout, family, mode, args.pytest_args.split()) for mode in ("stock", "sparse")}
        if None in results.values():
            differs = True
            continue
        counts = {mode: Counter(outcomes.values()) for mode, outcomes in results.items()}
        print(f"{family}: " + "; ".join(f"{mode} " + ", ".join(f"{n} {kind}" for kind, n in sorted(c.items()))
                                        for mode, c in counts.items()))
        for test in sorted(set(results["stock"]) | set(results["sparse"])):
            stock, sparse = results["stock"].get(test), results["sparse"].get(test)
            if stock != sparse:
                differs = True
                print(f"  {test}: stock {stock}, sparse {sparse}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
