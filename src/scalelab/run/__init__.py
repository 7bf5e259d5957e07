"""What wraps one run in the runner, above the strategies' measuring tools: the session that
switches on --trace/--nvml/--per-layer/--timeline (`session.py`) and the summary's trust lines
(`numbers.py`)."""
