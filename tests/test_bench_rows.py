"""The benchmark scripts: the row syntax (benchmarks.bench.parse_rows), and the whole-step
rows of benchmarks.step_bench on a tiny CPU problem."""
from benchmarks.bench import parse_rows


def test_parse_rows():
    assert parse_rows("full@8192,causal@16384@64, document@16384") == [
        ("full", 8192, 128), ("causal", 16384, 64), ("document", 16384, 128)]


def test_step_bench_rows_on_cpu():
    """benchmarks.step_bench (issue 16's whole-step row) on a tiny CPU problem: each mask
    that holds a tensor, built inside the step, gives exactly the output and gradients of
    its descriptor compiled once, and both are timed."""
    from benchmarks import step_bench
    rows = step_bench.run(L=128, B=1, H=2, D=16, device="cpu", reps=1, compile_too=False)
    assert [r["mask"] for r in rows] == list(step_bench.tensor_masks(2, 128, "cpu"))
    for r in rows:
        assert r["max_abs_diff"] == 0.0, r
        assert r["once_ms"] > 0 and r["every_step_ms"] > 0, r
        assert r["pipelined_once_ms"] > 0 and r["pipelined_every_step_ms"] > 0, r
