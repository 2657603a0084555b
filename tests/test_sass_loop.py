"""The SASS reader of scripts/sass_loop.py: it counts the innermost loop that holds MMAs, not an outer loop
around it nor a loop without MMAs."""
import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("sass_loop", Path(__file__).parents[1] / "scripts" / "sass_loop.py")
sass_loop = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sass_loop)

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IMAD R2, R2, R3, RZ ;
.L_x_1:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ ;
        /*0030*/                   MUFU.EX2 R4, R5 ;
        /*0040*/                   FFMA R6, R4, R7, R8 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
        /*0060*/                   FADD R9, R9, R10 ;
        /*0070*/               @P1 BRA `(.L_x_0) ;
.L_x_2:
        /*0080*/                   NOP ;
        /*0090*/                   BRA `(.L_x_2) ;
"""


def test_innermost_loop_with_mmas_is_counted():
    assert dict(sass_loop.loop_histogram(SASS)) == {"HGMMA": 1, "MUFU": 1, "FFMA": 1, "BRA": 1}
