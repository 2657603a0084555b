"""scripts/pv_rounding.py: the e4m3 roundings of P and of V each cost about as much, together more than either, and
a two-term V leaves P's alone; 8-bit integer operands (u8 P, int8 V per channel) round finer than e4m3 ones."""
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


def test_integer_operands_round_finer_than_e4m3_ones():
    errors = pv_rounding.rounding_errors(*pv_rounding.gaussian_inputs(512, 2, 128, seed=0))
    # 255 uniform steps for P in [0, 1] and 255 for V's channel range, against e4m3's 3 mantissa bits
    assert 0 < errors["P as u8, V as int8 per channel"] < 0.8 * errors["P and V rounded (the kernels)"]
