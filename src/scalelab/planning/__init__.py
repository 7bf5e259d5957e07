"""Planning: pure code that predicts or plans a run (schedule simulation, ...); it imports
nothing from strategies/, so predict/ and the strategies both build on it."""
