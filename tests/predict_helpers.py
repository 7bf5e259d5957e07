"""Paths shared by the `scalelab predict` tests: the checked-in measurements they predict
(tests/fixtures/predict, copies of benchmarks/results), the 4x H200 host's study, the frozen
copy of every device record predict reads, and the ceilings files."""

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "predict"
CEILINGS = FIXTURES / "ceilings_h200x2.json"
PLAN_CEILINGS = FIXTURES.parent / "plan" / "ceilings_2core.json"
FOUR_GPUS = Path(__file__).parent / "fixtures" / "predict_h200x4"
# A frozen copy of the device records (and ceilings) under benchmarks/results that predict
# reads, so a later measurement there moves no test: tests/fixtures/predict_committed/README.md
COMMITTED = Path(__file__).parent / "fixtures" / "predict_committed"
