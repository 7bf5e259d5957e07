"""`scalelab plan`: the fastest way to run a model on given hardware, chosen with the
calibrated performance model (scalelab.predict) and then proved by measuring the few best.

    space.py       what is planned: the workload, the hardware, the batch rule (PlanSpec)
    candidates.py  candidate configurations, one source per strategy (registry SOURCES)
    memory.py      bytes per device of a candidate (the `fit` estimate), for the filter
    rank.py        every candidate predicted and ranked: a DataFrame
    calibrate.py   the one-rank measurements the ranking lacks (--calibrate-missing)
    verify.py      the top K and the plain choice measured, interleaved; the regret
"""
