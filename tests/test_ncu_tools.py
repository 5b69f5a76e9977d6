"""The ncu export readers of tests/gpu (run on the CPU machine against made-up exports):
the phase split of a kernel's loop, and exports of kernels the profile did not record."""
import csv
import subprocess
import sys
from pathlib import Path

GPU_TOOLS = Path(__file__).parent / "gpu"
sys.path.insert(0, str(GPU_TOOLS))
import ncu_phases  # noqa: E402

HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
        "stall_wait", "stall_short_sb", "stall_barrier (Not Issued)"]


def write_export(path, rows):
    with open(path, "w", newline="") as f:
        f.write("==PROF== a line ncu prints before the table\n")
        w = csv.writer(f)
        w.writerow(HEAD)
        for r in rows:
            w.writerow(r)


def test_phases_split_the_loop_at_landmarks(tmp_path):
    step = 1000
    rows = [
        ("0x10", "MOV R1, c[0x0][0x28]", 7, 1, 7, 0, 0),                       # prologue: not the loop
        ("0x20", "HGMMA.64x80x16.F32.BF16 R152, gdesc[UR20], RZ, !UPT", 30, step, 10, 0, 0),
        ("0x30", "HGMMA.64x80x16.F32.BF16 R152, gdesc[UR24], R152", 20, step, 5, 0, 0),
        ("0x40", "UIADD3 UR4, UR4, 0x1, URZ", 5, step, 5, 0, 0),
        ("0x50", "WARPGROUP.DEPBAR.LE gsb0, 0x1", 100, step, 0, 0, 90),
        ("0x60", "FFMA.FTZ R8, R192, R3, -R9", 60, step, 0, 55, 0),
        ("0x70", "@!P0 BRA 0x20", 2, 2 * step, 2, 0, 0),
        ("0x80", "BAR.SYNC.DEFER_BLOCKING 0x9, 0x100", 40, step, 40, 0, 0),
        ("0x90", "EXIT", 1, 3, 1, 0, 0),                                        # epilogue
    ]
    path = tmp_path / "k.csv"
    write_export(path, rows)
    total, out = ncu_phases.phases(str(path))
    assert total == 265
    # the two HGMMAs fold into one phase with the UIADD3 after them; the wait, the barrier
    # each start one; the prologue and epilogue are left out
    assert [(p[0], p[2], p[3]) for p in out] == [("0x20", 55, 3), ("0x50", 162, 3), ("0x80", 40, 1)]
    assert out[1][4]["short_sb"] == 55 and out[1][4]["wait"] == 2
    assert "barrier (Not Issued)" not in out[1][4] and "barrier" not in out[1][4]


def test_phases_of_two_loop_copies(tmp_path):
    """A kernel with a loop for masked steps (a quarter of them) and one for the others:
    both copies are the loop; an HGMMA run only a few times (the prologue) is not."""
    masked, plain = 250, 750
    rows = [
        ("0x10", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR20], RZ, !UPT", 1, 3, 1, 0, 0),
        ("0x20", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR20], RZ, !UPT", 30, masked, 10, 0, 0),
        ("0x30", "FSEL R8, R8, -INF, P0", 20, masked, 0, 20, 0),
        ("0x40", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 50, masked, 0, 0, 50),
        ("0x50", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR20], RZ, !UPT", 60, plain, 20, 0, 0),
        ("0x60", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 90, plain, 0, 0, 90),
        ("0x70", "EXIT", 1, 3, 1, 0, 0),
    ]
    path = tmp_path / "k.csv"
    write_export(path, rows)
    total, out = ncu_phases.phases(str(path))
    assert [(p[0], p[2], p[3]) for p in out] == [("0x20", 50, 2), ("0x40", 50, 1), ("0x50", 60, 1),
                                                 ("0x60", 90, 1)]


def test_tools_skip_kernels_not_profiled(tmp_path):
    empty = tmp_path / "fwd_kernel.csv"
    empty.write_text('"Address","Function Name"\n')
    for tool in ("ncu_phases.py", "ncu_opcode_hist.py", "sass_gaps.py"):
        res = subprocess.run([sys.executable, str(GPU_TOOLS / tool), str(empty)],
                             capture_output=True, text=True)
        assert res.returncode == 0, (tool, res.stderr)
        assert "not profiled" in res.stdout, (tool, res.stdout)
