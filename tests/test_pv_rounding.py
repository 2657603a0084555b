"""scripts/pv_rounding.py: the e4m3 roundings of P and of V each cost about as much, together more than either, and
a two-term V leaves P's alone."""
import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("pv_rounding", Path(__file__).parents[1] / "scripts" / "pv_rounding.py")
pv_rounding = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pv_rounding)


def test_p_and_v_roundings_add_up_and_a_two_term_v_leaves_p_alone():
    errors = pv_rounding.rounding_errors(*pv_rounding.gaussian_inputs(512, 2, 128, seed=0))
    p, v = errors["P rounded"], errors["V rounded"]
    both, two_term = errors["P and V rounded (the kernels)"], errors["P rounded, V as two e4m3 terms"]
    assert 0 < p < both and 0 < v < both
    assert abs(two_term - p) < 0.05 * p  # V's residual, rounded again, is 2^-4 of V's rounding
