"""benchmarks/gather_probe.py on CPU: the Triton gather kernel under TRITON_INTERPRET=1
(tests/conftest.py) against torch indexing, and the probe's index patterns. fp32/fp16
only (bf16 is not meaningful in the interpreter). The GPU timings are not run here."""
import os

import pytest
import torch

if os.environ.get("FLEXSPARSE_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: TRITON_INTERPRET is not 1", allow_module_level=True)

from benchmarks import gather_probe as gp  # noqa: E402


def _want(table, idx, rows_per_prog):
    """Per-program fp64 sums of the gathered rows."""
    rows = table.double()[idx.long()]
    n = -(-idx.numel() // rows_per_prog)
    return torch.stack([rows[p * rows_per_prog:(p + 1) * rows_per_prog].sum(0) for p in range(n)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("R,D,N,block_r,rpp", [
    (50, 16, 100, 32, 64),      # N not a multiple of rows per program: masked tail
    (7, 32, 128, 16, 64),       # EVEN: N a multiple of rows per program; rows reused
    (300, 64, 96, 32, 1000),    # rows per program rounded down to a multiple of BLOCK_R
    (3, 16, 5, 16, 16),         # fewer rows than one block
])
def test_gather_sum_matches_torch(dtype, R, D, N, block_r, rpp):
    g = torch.Generator().manual_seed(R + N)
    table = torch.randn((R, D), generator=g).to(dtype)
    idx = torch.randint(0, R, (N,), generator=g, dtype=torch.int32)
    out = gp.gather_sum(table, idx, block_r=block_r, rows_per_prog=rpp)
    rpp_used = max(block_r, rpp // block_r * block_r)
    want = _want(table, idx, rpp_used)
    assert out.dtype == torch.float32 and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    # the whole gather, as the probe's consumer would check it
    torch.testing.assert_close(out.double().sum(0), table.double()[idx.long()].sum(0),
                               rtol=1e-5, atol=1e-3)


def test_gather_sum_empty_and_bad_inputs():
    table = torch.randn((4, 16))
    out = gp.gather_sum(table, torch.zeros(0, dtype=torch.int32))
    assert out.shape == (1, 16) and torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match="int32"):
        gp.gather_sum(table, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="power of two"):
        gp.gather_sum(torch.randn((4, 24)), torch.zeros(4, dtype=torch.int32))


def test_gather_sum_probe_sizes_are_even():
    # the benchmark's index lists fill every program: the kernel runs without masks
    for pattern in gp.PATTERNS:
        for R in (1 << 15, 3000):
            idx = gp.make_indices(pattern, R, device="cpu")
            for rpp in gp.ROWS_PER_PROG + gp.QUICK_ROWS_PER_PROG:
                assert idx.numel() % rpp == 0


@pytest.mark.parametrize("R", [300, 1 << 15])
def test_index_patterns(R):
    uni = gp.make_indices("uniform", R, device="cpu")
    assert uni.dtype == torch.int32 and uni.numel() >= max(R, gp.MIN_ROWS)
    assert int(uni.min()) >= 0 and int(uni.max()) < R
    loc = gp.make_indices("local", R, device="cpu")
    assert loc.dtype == torch.int32 and int(loc.min()) >= 0 and int(loc.max()) < R
    lists = loc.view(-1, gp.LOCAL_W)
    assert lists.shape[0] * gp.LOCAL_STEP >= R              # the centres sweep the table
    assert torch.equal(lists, lists.sort(-1).values)        # each list sorted
    centre = torch.arange(lists.shape[0])[:, None] * gp.LOCAL_STEP
    dist = (lists.long() - centre + gp.LOCAL_WINDOW // 2) % R   # offset in the window
    assert int(dist.max()) < gp.LOCAL_WINDOW
    with pytest.raises(ValueError, match="pattern"):
        gp.make_indices("strided", R, device="cpu")


def test_table_and_row_format():
    t = gp.make_table(128, 1 << 16, dtype=torch.float16, device="cpu")
    assert t.shape == (512, 64) and t.dtype == torch.float16
    row = dict(row_bytes=256, ws_mb=8, pattern="uniform", rows=1 << 21, gbs=float("nan"),
               config=gp.label((64, 4, 3), 2048), index_select=1.0, embedding_bag=2.0)
    line = gp.format_row(row)
    assert line.startswith("| 256 | 8 | uniform |") and "n/a" in line and "R64 w4 s3 rpp2048" in line
    assert line.count("|") == gp.HEADER.splitlines()[0].count("|")


def test_index_bench_tables_have_the_ceiling_column():
    import math
    from benchmarks import bench_indices as bi
    row = dict(L=8192, W=64, fwd_ms=1.0, fwd_tflops=1.0, kv_tbs=2.0, kv_frac=0.5,
               fwd_bwd_ms=2.0, fwd_bwd_tflops=1.0, ceil_tbs=4.0, ceil_frac=0.5)
    head = bi.HEADER.splitlines()
    assert "gather ceiling" in head[0] and head[0].count("|") == head[1].count("|")
    line = bi._format_row(row)
    assert line.count("|") == head[0].count("|") and "| 4.00 (50%) |" in line
    assert "CUDA fwd ms" in head[0] and "| n/a (n/a%) | " in line     # no CUDA timing given
    row.update(cuda_fwd_ms=0.5, cuda_ceil_frac=1.0)
    assert "| 0.500 (100%) |" in bi._format_row(row)
    row.update(ceil_tbs=math.nan, ceil_frac=math.nan)      # --no-ceiling
    assert "| n/a (n/a%) |" in bi._format_row(row)


def test_run_and_ceiling_plumbing_on_cpu(monkeypatch):
    # the table and ceiling() control flow, with every timing replaced by 1 ms
    calls = []

    def fake_bench(fn):
        fn()
        calls.append(fn)
        return 1.0

    monkeypatch.setattr(gp, "_bench", fake_bench)
    monkeypatch.setattr(gp, "MIN_ROWS", 1024)
    monkeypatch.setattr(gp, "ROW_ALIGN", 1024)
    monkeypatch.setattr(gp, "CONFIGS", [(32, 4, 2), (64, 4, 2)])
    monkeypatch.setattr(gp, "ROWS_PER_PROG", (1024,))
    monkeypatch.setattr(gp, "QUICK_ROWS_PER_PROG", (512,))
    logged = []
    rows = gp.run(quick=False, budget_s=None, row_bytes=(64,), log=logged.append,
                  working_sets_mb=(1 / 64, 1 / 32), dtype=torch.float16, device="cpu")
    assert [(r["ws_mb"], r["pattern"]) for r in rows] == [
        (1 / 64, "uniform"), (1 / 64, "local"), (1 / 32, "uniform"), (1 / 32, "local")]
    for r in rows:
        assert r["gbs"] == r["rows"] * 64 / 1e6       # gathered rows x row bytes per ms
        assert r["config"].endswith("rpp1024") and r["rows"] % 1024 == 0
    assert sum(line.startswith("# pre-sweep") for line in logged) == 2 * 2
    gp.measure.cache_clear()
    try:
        c = gp.ceiling(64, 1 << 14, dtype=torch.float16, device="cpu")
        assert c == 1024 * 64 / 1e6                   # N = MIN_ROWS rows of 64 bytes
        n = len(calls)
        assert gp.ceiling(64, 1 << 14, dtype=torch.float16, device="cpu") == c
        assert len(calls) == n                        # cached
    finally:
        gp.measure.cache_clear()
