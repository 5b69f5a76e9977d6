"""The benchmark scripts: the row syntax (benchmarks.bench.parse_rows), and the whole-step
rows of benchmarks.step_bench on a tiny CPU problem."""
import math

from benchmarks.bench import parse_rows


def test_parse_rows():
    assert parse_rows("full@8192,causal@16384@64, document@16384") == [
        ("full", 8192, 128), ("causal", 16384, 64), ("document", 16384, 128)]


def test_step_bench_rows_on_cpu():
    """benchmarks.step_bench (issue 16's whole-step row) on a tiny CPU problem: each mask
    that holds a tensor, built inside the step, gives exactly the output and gradients of
    its descriptor compiled once, and both are timed. (Exactly: on one torch thread,
    conftest.py.)"""
    from benchmarks import step_bench
    rows = step_bench.run(L=128, B=1, H=2, D=16, device="cpu", reps=1, compile_too=False,
                          variants=(8589934592,))
    assert [r["mask"] for r in rows] == list(step_bench.tensor_masks(2, 128, "cpu"))
    for r in rows:
        assert r["max_abs_diff"] == 0.0, r
        assert r["once_ms"] > 0 and r["every_step_ms"] > 0, r
        assert r["pipelined_once_ms"] > 0 and r["pipelined_every_step_ms"] > 0, r
        # the compiled-once step timed a second time in the same turns: a positive time
        assert math.isfinite(r["pipelined_aa_pct"]) and r["pipelined_aa_pct"] > -100.0, r
        assert len(r["variant_pipelined_ms"]) == 1 and r["variant_pipelined_ms"][0] > 0, r


def test_step_bench_cudagraph_mode_rows_on_cpu():
    """step_bench --cudagraphs: the mode "cudagraphs" (the forward compiled with
    mode="reduce-overhead") gives the compiled-once output and gradients exactly, and its
    row counts the graphs Inductor skipped: on CPU it captures none, and says so. All four
    masks beside the compiled mode: on the 2026-11-29 H200 visit the two compiled modes
    shared one code object and passed Dynamo's recompile limit (a hard failure under
    fullgraph=True)."""
    from benchmarks import step_bench
    rows = step_bench.run(L=128, B=1, H=2, D=16, device="cpu", reps=1, compile_too=True,
                          cudagraphs=True)
    masks = list(step_bench.tensor_masks(2, 128, "cpu"))
    assert [(r["mask"], r["mode"]) for r in rows] == [
        (m, mode) for m in masks for mode in ("eager", "compiled", "cudagraphs")]
    for r in rows:
        assert r["max_abs_diff"] == 0.0 and r["every_step_ms"] > 0, r
        if r["mode"] != "cudagraphs":
            assert r["graph_skips"] is None, r
        elif step_bench.cudagraph_skips() is not None:   # Inductor's counter exists here
            assert r["graph_skips"] >= 1 or r["mask"] != masks[0], r


def test_cuda_bench_backends_take_turns():
    """cuda_bench --rounds: the backends are timed in turns, in an order rotated every
    round, each column the median of its rounds; one that raises is reported once and
    takes no more turns."""
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

    seen = []
    got = interleaved({n: run(n) for n in ("a", "bad", "b")}, 3, timer=timer, report=reports.append,
                      turns=lambda *t: seen.append(t))
    # round 0 in order, then rotated by one and by two places ("bad" left after round 0)
    assert order == ["a", "bad", "b", "b", "a", "b", "a"]
    assert got == {"a": 2.0, "b": 5.0}
    assert reports == ["bad: RuntimeError: no kernel"]
    # every timing with its round and its place among the timings of that round
    assert seen == [(0, 0, "a", 3.0), (0, 1, "b", 5.0), (1, 0, "b", 4.0), (1, 1, "a", 1.0),
                    (2, 0, "b", 9.0), (2, 1, "a", 2.0)]


def test_in_turns_rotates_the_settings(monkeypatch):
    """debug_bits.in_turns: every setting (the default, then each FLEXSPARSE_CUDA_DEBUG
    value) measured once per round under its own value, the order rotated every round so
    that no setting holds one place throughout; each result the median of its rounds."""
    import os
    from benchmarks.debug_bits import in_turns, rotated
    assert rotated(3, 0) == [0, 1, 2] and rotated(3, 1) == [1, 2, 0] and rotated(3, 4) == [1, 2, 0]
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    seen = []
    place_cost = iter([0.0, 10.0, 20.0] * 3)     # a slow third place in every round

    def measure():
        bits = os.environ.get("FLEXSPARSE_CUDA_DEBUG", "default")
        seen.append(bits)
        return {"default": 1.0, "4": 2.0, "8": 3.0}[bits] + next(place_cost)
    got = in_turns(measure, [4, 8], 3)
    assert seen == ["default", "4", "8", "4", "8", "default", "8", "default", "4"]
    assert "FLEXSPARSE_CUDA_DEBUG" not in os.environ
    # each setting sat once in each place: its median is its own cost plus the middle place's
    assert got == [11.0, 12.0, 13.0]


def test_cuda_bench_row_spec_skips_option_values():
    from benchmarks.cuda_bench import DEFAULT, row_spec
    assert row_spec(["--rounds", "3"]) == DEFAULT
    assert row_spec(["full@8192@128", "--rounds", "3"]) == "full@8192@128"
    assert row_spec(["--rounds", "3", "causal@4096@64"]) == "causal@4096@64"
    assert row_spec(["--timer", "back_to_back", "--per-round", "sliding@8192"]) == "sliding@8192"
    assert row_spec(["--timer", "back_to_back"]) == DEFAULT
    assert row_spec([]) == DEFAULT


def _gpu_script(name):
    """tests/gpu/<name>.py (a device-side probe script) loaded as a module, for its
    host-side readers."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "gpu", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bwd_trace_summary_reads_the_stamps():
    """tests/gpu/bwd_trace.py (the backward's timeline probe): the stamps of the second
    launch are read, and each phase's median over the steady steps comes out."""
    bt = _gpu_script("bwd_trace")
    lines = ["BWDTRACE 0 0 0 " + " ".join(["1"] * 12), "=== launch 0 done", "BWDCAL 0 0 0 1800 1000"]
    for s in range(6):      # steps 1000 cycles apart, event e at 10 * e (+5 for wg 1)
        for wg in (0, 1):
            lines.append(f"BWDTRACE 0 {wg} {s} " + " ".join(str(1000 * s + 10 * e + 5 * wg) for e in range(12)))
    lines.append("=== launch 1 done")
    steps, cal = bt.parse("\n".join(lines))
    assert set(steps) == {(0, 0), (0, 1)} and len(steps[(0, 0)]) == 6 and cal == {0: [0, 0, 1800, 1000]}
    text = bt.summarize("full@8192@128", "268435456", steps, cal)
    assert "64-row steps, tensor-core floor per step 2560 cycles" in text
    assert "1.800 cycles per ns" in text
    assert "CTA 0 wg0: 6 steps, period 1000" in text and "exponentials 10" in text
    assert "to the next stage 890" in text
    assert bt.step_rows("full@8192@128", "0") == 80 and bt.step_rows("full@8192@128", "268435456") == 64
    assert bt.step_rows("causal@8192@128", "0") == 64 and bt.step_rows("full@8192@64", "0") == 128


def test_bwd_trace_reads_the_stamps_from_the_op_buffer():
    """tests/gpu/bwd_trace.py: the op flexsparse::bwd_trace's buffer (CTA slot, step,
    warpgroup, event; uint32 clocks in int32; the calibration row last) becomes the lines
    parse() reads."""
    import torch
    bt = _gpu_script("bwd_trace")
    S = bt.TRACE_STEPS
    buf = torch.zeros(3, S + 1, 2, 12, dtype=torch.int64)
    for s in range(6):
        for wg in (0, 1):
            buf[2, s, wg] = torch.tensor([1000 * (s + 1) + 10 * e + 5 * wg for e in range(12)])
    buf[2, 4, 1, 11] = 2 ** 32 - 3
    buf[2, S, 0, :5] = torch.tensor([0, 0, 1800, 1000, 66])   # clock, timer, clock, timer, CTA
    text = "\n".join(["=== launch 0 done"] + bt.trace_lines(buf.to(torch.int32)) + ["=== launch 1 done"])
    steps, cal = bt.parse(text)
    assert set(steps) == {(66, 0), (66, 1)} and len(steps[(66, 0)]) == 6
    assert cal == {66: [0, 0, 1800, 1000]} and steps[(66, 1)][4][11] == 2 ** 32 - 3


def test_bwd_trace_life_summary():
    """tests/gpu/bwd_trace.py's CTA-life reader (BWD_LIFE, trace builds): the op
    flexsparse::bwd_life's buffer (CTA, event; uint32 SM clocks in int32, event 0 the SM
    + 1, unrecorded rows zero) becomes BWDLIFE lines, and the summary orders each SM's
    CTAs by entry (across the clock's wrap) and gives each phase's median, the gap between
    one CTA's end and the next one's entry, and the fixed cost per CTA."""
    import torch
    bt = _gpu_script("bwd_trace")
    buf = torch.zeros(16, 8, dtype=torch.int64)
    cta = 0
    for sm in range(2):
        for i in (2, 0, 1):           # recorded out of order; SM 0's clock wraps after CTA 0
            e1 = ((2 ** 32 - 500) + 1000 * i if sm == 0 else 1000 * i) % 2 ** 32
            offsets = (100, 900, 950, 960, 300)   # K/V, last step, stores read, dQ writer, producer
            buf[cta] = torch.tensor([sm + 1, e1] + [(e1 + o) % 2 ** 32 for o in offsets] + [4])
            cta += 1
    lines = bt.life_lines(buf.to(torch.int32))
    assert len(lines) == 6 and lines[0].startswith("BWDLIFE 0 1 ")
    text = "\n".join(["=== launch 0 done"] + lines + ["=== launch 1 done"])
    summary = bt.life_summary(text)
    assert "6 CTAs on 2 SMs, median 4 steps" in summary
    assert "entry to K/V 100" in summary and "last step's end 800 (200 per step)" in summary
    assert "stores read 50" in summary and "CTA's end 10" in summary
    assert "next CTA's entry 40" in summary and "less steps) 200" in summary
    assert "no records" in bt.life_summary("=== launch 0 done\n=== launch 1 done")
    # the persistent kernel's tiles: no dQ writer's read (event 5 zero) but on a CTA's last
    # tile, so a tile ends at its stores' read
    buf[:, 5] = 0
    summary = bt.life_summary("\n".join(["=== launch 0 done"] + bt.life_lines(buf.to(torch.int32))
                                         + ["=== launch 1 done"]))
    assert "CTA's end 0" in summary and "next CTA's entry 50" in summary, summary


def test_fwd_trace_reads_the_stamps_from_the_op_buffer():
    """tests/gpu/fwd_trace.py (the forward's timeline probe): the op flexsparse::fwd_trace's
    buffer (CTA slot, tile, role, event; uint32 clocks in int32) becomes the lines parse()
    reads, with each slot's CTA index and its calibration row, and the summary gives the
    steady period and the clock rate."""
    import torch
    ft = _gpu_script("fwd_trace")
    T = ft.TRACE_TILES
    buf = torch.zeros(3, T, 4, 8, dtype=torch.int64)
    for t in range(8):                   # slot 1 (CTA 1): key tiles 1000 cycles apart
        for role in (0, 1):
            buf[1, t, role] = torch.tensor([1000 * (t + 1) + 10 * e + 5 * role for e in range(8)])
    buf[1, T - 1, 3, :5] = torch.tensor([100, 1000, 1900, 1500, 1])   # clock, timer, clock, timer, CTA
    buf[1, 3, 0, 0] = 2 ** 32 - 7        # a clock past 2^31 (int32 bits): read back unsigned
    lines = ft.trace_lines(buf.to(torch.int32))
    assert all(ln.startswith("FWDTRACE 1 ") for ln in lines) and len(lines) == 8 + 8 + 1
    assert f"FWDTRACE 1 0 3 {2 ** 32 - 7} " in "\n".join(lines) + " "
    buf[1, 3, 0, 0] = 4000               # (its value again)
    text = "\n".join(["=== launch 0 done"] + ft.trace_lines(buf.to(torch.int32)) + ["=== launch 1 done"])
    trace = ft.parse(text)
    assert set(trace) == {(1, 0), (1, 1), (1, 3)}
    summary = ft.summarize("full@8192@128", trace)
    assert "CTA 1: clock 3.600 cycles per ns" in summary
    assert "wg0: 8 tiles, period 1000" in summary and "wg1: 8 tiles, period 1000" in summary


def test_cuda_index_bench_variants_set_and_restore_the_debug_bits(monkeypatch):
    """--variants times the CUDA forward under each FLEXSPARSE_CUDA_DEBUG value: with_debug
    sets the value for the call only, and restores what was there (or its absence)."""
    import os

    from benchmarks.debug_bits import with_debug
    seen = []
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    assert with_debug(1073741824, lambda: seen.append(os.environ["FLEXSPARSE_CUDA_DEBUG"]) or 7) == 7
    assert seen == ["1073741824"] and "FLEXSPARSE_CUDA_DEBUG" not in os.environ
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "8")
    with_debug(536870912, lambda: seen.append(os.environ["FLEXSPARSE_CUDA_DEBUG"]))
    assert seen[-1] == "536870912" and os.environ["FLEXSPARSE_CUDA_DEBUG"] == "8"


def test_build_bench_variants_take_turns_with_the_default(monkeypatch):
    """build_bench --variants: the default and each FLEXSPARSE_CUDA_DEBUG value are timed in
    turns (the order rotated each round), three rounds, each under its own setting, and
    the medians come back in order."""
    import os

    import benchmarks.build_bench as bb
    seen = []
    fake_us = {None: [5.0, 1.0, 3.0], "8589934592": [30.0, 10.0, 20.0]}

    def fake_time_us(fn, reps):
        key = os.environ.get("FLEXSPARSE_CUDA_DEBUG")
        seen.append(key)
        return fake_us[key][sum(1 for s in seen if s == key) - 1]

    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    monkeypatch.setattr(bb, "time_us", fake_time_us)
    default, variants = bb.turns(lambda: None, [8589934592], reps=1)
    # rounds in rotated order (debug_bits.in_turns)
    assert seen == [None, "8589934592", "8589934592", None, None, "8589934592"]
    assert default == 3.0 and variants == [20.0]
    assert "FLEXSPARSE_CUDA_DEBUG" not in os.environ
    seen.clear()
    assert bb.turns(lambda: None, [], reps=1) == (5.0, []) and seen == [None]   # one timing


def test_build_bench_graph_input_on_cpu():
    """build_bench --graphed replays a captured build after copying other data into the
    mask's input tensor: for every case that tensor is the one the mask is made from (a
    change to it changes the next build), the other data makes a valid mask with another
    descriptor, and same_descriptor tells the two apart (and a descriptor equals itself)."""
    from benchmarks import build_bench as bb
    L = 1024
    for name, (make, _) in bb.cases(L, "cpu", 2).items():
        inp, new = bb.graph_input(name, make, L)
        assert new.shape == inp.shape and new.dtype == inp.dtype, name
        before = make().compile(1, 2, 2, L, L, device="cpu", block_size=128)
        assert bb.same_descriptor(before, before), name
        saved = inp.clone()
        inp.copy_(new)
        try:
            after = make().compile(1, 2, 2, L, L, device="cpu", block_size=128)
        finally:
            inp.copy_(saved)
        assert not bb.same_descriptor(before, after), name
        assert bb.same_descriptor(before, make().compile(1, 2, 2, L, L, device="cpu", block_size=128)), name


def test_cuda_bench_merge_tables_takes_medians_and_recomputes_ratios():
    """cuda_bench --merge: the tables of several processes as one, each TFLOP/s column the
    median of the processes that have it (a failed FLASH column stays nan and the ratio
    falls back to Flex), ratios from the medians, errors the largest; other lines dropped."""
    from benchmarks.cuda_bench import HEADER, merge_tables, table_line
    nan = float("nan")

    def tf(cuda, flash, cuda_bwd, flash_bwd, flex=300.0):
        return {"cuda": cuda, "triton": 400.0, "flex": flex, "flash": flash, "sdpa": nan,
                "cuda_bwd": cuda_bwd, "triton_bwd": 350.0, "flex_bwd": 250.0, "flash_bwd": flash_bwd,
                "sdpa_bwd": nan}
    runs = [(600.0, 650.0, 500.0, 520.0), (660.0, 640.0, 530.0, 500.0), (630.0, 700.0, 520.0, 510.0)]
    texts = []
    for i, r in enumerate(runs):
        lines = ["NVIDIA H200, torch x", HEADER, "causal flash: some warning",
                 table_line("causal | 8K | 128", tf(*r), 1e-3 * (i + 1), 2e-3),
                 table_line("block_sparse | 8K | 128", tf(500.0 + i, nan, 400.0, nan), 1e-3, 1e-3),
                 "| full@8192@128 | failed: RuntimeError: x |"]
        texts.append("\n".join(lines))
    merged = merge_tables(texts).splitlines()
    assert len(merged) == 2
    assert merged[0] == table_line("causal | 8K | 128", tf(630.0, 650.0, 520.0, 510.0), 3e-3, 2e-3)
    cells = [c.strip() for c in merged[0].strip("|").split("|")]
    assert cells[3] == "630" and cells[6] == "650" and cells[-2] == f"{630 / 650:.2f} / {520 / 510:.2f}"
    # FLASH did not run: the ratio is to Flex, the FLASH column stays nan
    cells = [c.strip() for c in merged[1].strip("|").split("|")]
    assert cells[3] == "501" and cells[6] == "nan" and cells[-2] == f"{501 / 300:.2f} / {400 / 250:.2f}"


def test_cuda_bench_call_by_call_alternates_calls():
    """cuda_bench --timer call_by_call: the backends' single calls alternate call by call
    (the order rotated every cycle), each call between its own two events; untimed cycles
    first; each column the median of its timed calls; one that raises on its first call is
    reported and left out. A clock that slows down during the run reaches both alike."""
    from benchmarks.cuda_bench import call_by_call
    now = [0.0]
    cost = {"a": 1.0, "b": 2.0}
    calls, reports, seen = [], [], []

    class Event:
        def record(self):
            self.t = now[0]

        def elapsed_time(self, other):
            return other.t - self.t

    def run(name):
        def fn():
            if name == "bad":
                raise RuntimeError("no kernel")
            calls.append(name)
            now[0] += cost[name] * (1 + len(calls) / 100)    # a clock that slows down
        return fn

    got = call_by_call({n: run(n) for n in ("a", "bad", "b")}, 2, report=reports.append,
                       turns=lambda *t: seen.append(t), ms=6.0, flush=False, event=Event,
                       synchronize=lambda: None)
    assert reports == ["bad: RuntimeError: no kernel"]
    # the first calls, a sizing cycle and one untimed cycle (a, b each), then the timed
    # cycles, the order rotated every cycle: 6 ms per callable and round over a ~3.1 ms
    # cycle is 3 cycles per round, 2 rounds
    assert calls[:6] == ["a", "b"] * 3
    assert calls[6:] == ["a", "b", "b", "a"] * 3
    assert len(calls) == 6 + 2 * 3 * 2
    # the slowdown reaches both: b stays twice a's time per call (within the drift of one call)
    assert 1.9 < got["b"] / got["a"] < 2.1, got
    assert [(r, p, n) for r, p, n, _ in seen] == [(0, None, "a"), (0, None, "b"), (1, None, "a"), (1, None, "b")]
