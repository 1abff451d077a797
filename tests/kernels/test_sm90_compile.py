"""benchmarks/sm90_compile.py compiles the GEMM kernels for sm_90 without a GPU (Triton's own
ptxas) and reads the machine code back: run it as a user would, on both kernels."""

import os
import subprocess
import sys

import pytest
from kernel_testing import SM90_COMPILE, has_triton, sm90_compile_report

from kiln.kernels.gemm import PREFETCH_K_STEPS


@has_triton
@pytest.mark.parametrize("args, wgmma_per_step", [
    (["gemm", "--block-n", "32", "--stages", "2"], 8),  # 128-deep K steps of 16-deep wgmmas
    (["wint_mma", "--block-n", "64", "--block-m", "64", "--k-step", "64", "--split", "2"], 4),
])  # fmt: skip
def test_sm90_compile_reports_the_k_loop(args, wgmma_per_step, tmp_path):
    report = sm90_compile_report(*args, "--dump", str(tmp_path))
    assert 0 < report["registers"] <= 255 and report["spill_stack_bytes"] == 0
    assert report["k_loop_wgmmas"] == wgmma_per_step
    assert report["k_loop_instructions"] > wgmma_per_step
    assert "LDGSTS" in report["k_loop_loads"]  # the operands stream through cp.async
    assert (tmp_path / f"{args[0]}.sass").read_text().count("HGMMA") >= wgmma_per_step


@has_triton
def test_gated_gemm_streams_both_weight_halves_through_tma(tmp_path):
    """Each 64-deep K step of the prefill gate/up GEMM: three TMA loads (x, the gate rows, the up
    rows) and two accumulators' wgmmas, within the register file."""
    report = sm90_compile_report("gated_gemm", "--dump", str(tmp_path))
    assert 0 < report["registers"] <= 255 and report["spill_stack_bytes"] == 0
    assert report["k_loop_loads"] == {"UTMALDG": 3}
    assert report["k_loop_wgmmas"] == 2 * 64 // 16
    assert report["shared_bytes"] <= 227 * 1024  # an H100 block's shared memory


@has_triton
@pytest.mark.parametrize("pdl", [False, True])
def test_gemm_asks_l2_for_its_first_weights_only_with_pdl(pdl):
    """With PDL each thread of the 64-column GEMM asks L2 for its share of the first K steps'
    weight lines before the wait (64 rows x 2 lines a 128-deep step over 128 threads: one a
    step), never in the K loop; without PDL there is nothing to overlap and no prefetch."""
    report = sm90_compile_report("gemm", "--block-n", "64", "--stages", "3",
                                 *(["--pdl"] if pdl else []))
    assert report["l2_prefetches"] == (PREFETCH_K_STEPS if pdl else 0)
    assert report["k_loop_l2_prefetches"] == 0


@has_triton
def test_sm90_compile_names_an_unknown_unspecialized_argument():
    run = subprocess.run([sys.executable, SM90_COMPILE, "gemm", "--unspecialized", "M,stride_zz"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "['stride_zz'] are not integer arguments of _gemm_kernel" in run.stderr


@has_triton
@pytest.mark.parametrize("args", [
    ["--bits", "8", "--per-channel", "--k-step", "64", "--block-m", "128", "--warps", "8",
     "--stages", "4", "--out-fp32"],  # the LM head of the int8 preset at 128 rows
    ["--bits", "8", "--per-channel", "--k-step", "64", "--block-n", "64", "--block-m", "16"],
])  # fmt: skip
def test_wint_mma_writes_no_register_of_a_wgmma_in_flight(args):
    """The next step's decode writes no register an unretired wgmma reads: by the installed
    Triton's pipelining, or by the wait wint_mma.retire_each_step adds where Triton 3.6 does not
    (these tiles had 77 and 51 such writes there without it)."""
    report = sm90_compile_report("wint_mma", *args)
    assert report["k_loop_wgmmas"] > 0 and report["wgmma_hazards"] == []


def _sass(*instructions: str) -> list[str]:
    """nvdisasm-style lines: an address comment, the instruction, a semicolon."""
    return [f"        /*{16 * i:04x}*/                   {text} ;"
            for i, text in enumerate(instructions)]


def test_wgmma_hazards_flags_writes_to_an_in_flight_operand_and_reads_of_its_accumulator():
    """The two faults wint_ws met (results/h100/wint_ws_overlap.txt 2.): a decode writing the
    register operand of a wgmma that a DEPBAR left running, and an epilogue reading the
    accumulator before the last DEPBAR; nothing once the DEPBAR has retired the group."""
    sys.path.insert(0, os.path.dirname(SM90_COMPILE))
    from sass_hazards import wgmma_hazards

    hgmma = "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR16], R24, gsb0"
    operand_write = _sass(hgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "LDS.128 R152, [R8+0x100]",
                          "@!P0 BRA `(.L_x_1)")
    assert wgmma_hazards(operand_write, cyclic=True) == ["LDS.128 R152, [R8+0x100]"]
    accumulator_read = _sass(hgmma, "F2FP.BF16.F32.PACK_AB R17, R31, R30",
                             "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert wgmma_hazards(accumulator_read, cyclic=False) == [
        "F2FP.BF16.F32.PACK_AB R17, R31, R30"]
    retired = _sass(hgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "LDS.128 R152, [R8+0x100]",
                    "F2FP.BF16.F32.PACK_AB R17, R31, R30")
    assert wgmma_hazards(retired, cyclic=True) == []
    # other registers are free while it runs; a store reading the accumulator is not
    assert wgmma_hazards(_sass(hgmma, "LDS.128 R200, [R8]", "STS.128 [R9], R200",
                               "WARPGROUP.DEPBAR.LE gsb0, 0x0"), cyclic=False) == []
    assert wgmma_hazards(_sass(hgmma, "STS.64 [R9], R86", "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
                         cyclic=False) == ["STS.64 [R9], R86"]
