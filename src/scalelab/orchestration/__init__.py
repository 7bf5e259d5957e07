"""Orchestration: what starts runs and jobs (sweeps, Slurm studies, the demo, fit's trials,
compare-devices, launching ranks and explaining how a job ended). Above the runner and
analysis/: it may start runs; analysis/ only reads their records."""
