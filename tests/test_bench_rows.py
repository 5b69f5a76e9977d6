"""The benchmark scripts' row syntax (benchmarks.bench.parse_rows)."""
from benchmarks.bench import parse_rows


def test_parse_rows():
    assert parse_rows("full@8192,causal@16384@64, document@16384") == [
        ("full", 8192, 128), ("causal", 16384, 64), ("document", 16384, 128)]
