"""`scalelab predict`: a performance model, calibrated on what was measured here, that says
how a study will scale before the cluster is booked.

    network.py        inter-node profiles (cited datasheets) or a measured file
    comm_model.py     alpha-beta messages and collectives (ring, tree, hierarchical)
    figures.py        the measured ceilings a prediction needs, with clear errors when absent
    calibration.py    one-rank measurements and how compute moves with the batch
    compute_model.py  calibrated compute, else the roofline bound
    models/           one model per strategy (registry MODELS)
    model_registry.py MODELS, and which model predicts a strategy (a subclass: its parent's)
    points.py         measured points found by content; validate.py: model vs measurement
    frame.py          predictions over N as a DataFrame, with the bottleneck named
"""
