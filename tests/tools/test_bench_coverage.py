"""Every benchmark in tools/bench has a smoke test in tests/tools that runs it at a tiny size; a
file another benchmark runs (a stand-in server) is covered by that benchmark's test."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def untested_benchmarks(bench_sources: dict[str, str], test_sources: list[str]) -> list[str]:
    """Names of the benchmarks (``{name: source}``) that no test source names, either as
    ``bench/<name>`` or as ``"<name>.py"``; a name another benchmark's source mentions is a helper."""
    helpers = {n for n in bench_sources if any(n in src for m, src in bench_sources.items() if m != n)}
    tests = "\n".join(test_sources)
    return sorted(n for n in set(bench_sources) - helpers if f"bench/{n}" not in tests and f'"{n}.py"' not in tests)


def test_the_check_finds_a_benchmark_without_a_test():
    benches = {"a": "x", "b": "runs server.py", "server": "a stand-in", "c": "y"}
    assert untested_benchmarks(benches, ['load_tool("bench/a")', 'os.path.join("bench", "b.py")']) == ["c"]


def test_every_benchmark_has_a_smoke_test():
    benches = {p.stem: p.read_text() for p in (ROOT / "tools" / "bench").glob("*.py")}
    here = pathlib.Path(__file__).name
    tests = [p.read_text() for p in (ROOT / "tests" / "tools").glob("test_*.py") if p.name != here]
    assert len(benches) >= 8 and untested_benchmarks(benches, tests) == []
