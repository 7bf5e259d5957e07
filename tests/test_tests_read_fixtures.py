"""No test reads benchmarks/results: those are measured device records a later measurement may
replace, and a test asserting over them would move with it. A test that needs such records
reads a frozen copy under tests/fixtures/ (predict_committed/, predict/, pipelining/)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def results_paths(source: str) -> list[int]:
    """Lines building a path into benchmarks/results: a string that starts with it, or
    `... / "benchmarks" / "results"` (text that only mentions it, as a README check, is fine)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and text.strip("./").startswith("benchmarks/results"):
            hits.append(node.lineno)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right, left = node.right, node.left
            while isinstance(left, ast.BinOp) and isinstance(left.op, ast.Div):
                left = left.right
            if (isinstance(right, ast.Constant) and right.value == "results"
                    and isinstance(left, ast.Constant) and left.value == "benchmarks"):  # fmt: skip
                hits.append(node.lineno)
    return hits


def test_no_test_reads_the_committed_benchmark_results():
    found = [f"{p.name}:{line}" for p in sorted(TESTS.glob("**/*.py")) if p != Path(__file__)
             for line in results_paths(p.read_text())]  # fmt: skip
    assert not found, f"tests reading benchmarks/results: {found}"


def test_the_check_sees_both_ways_of_building_the_path():
    assert results_paths('p = ROOT / "benchmarks/results/x.jsonl"\n') == [1]
    assert results_paths('p = Path(__file__).parents[1] / "benchmarks" / "results" / "c.json"\n')
    assert results_paths('assert line.endswith("--calibrate benchmarks/results")\n') == []
