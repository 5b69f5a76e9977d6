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


def test_cuda_bench_backends_take_turns():
    """cuda_bench --rounds: the backends are timed in turns, each column the median of its
    rounds; one that raises is reported once and takes no more turns."""
    from benchmarks.cuda_bench import interleaved
    order, reports = [], []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 9.0])}

    def timer(fn):
        return fn()

    def run(name):
        def fn():
            order.append(name)
            if name == "bad":
                raise RuntimeError("no kernel")
            return next(times[name])
        return fn

    got = interleaved({n: run(n) for n in ("a", "bad", "b")}, 3, timer=timer, report=reports.append)
    assert order == ["a", "bad", "b", "a", "b", "a", "b"]
    assert got == {"a": 2.0, "b": 5.0}
    assert reports == ["bad: RuntimeError: no kernel"]


def test_cuda_bench_row_spec_skips_option_values():
    from benchmarks.cuda_bench import DEFAULT, row_spec
    assert row_spec(["--rounds", "3"]) == DEFAULT
    assert row_spec(["full@8192@128", "--rounds", "3"]) == "full@8192@128"
    assert row_spec(["--rounds", "3", "causal@4096@64"]) == "causal@4096@64"
    assert row_spec([]) == DEFAULT
