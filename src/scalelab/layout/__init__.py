"""Planning: pure decisions about how a run is laid out (pipeline cuts and memory, schedule
simulation, halo geometry of a spatial trunk), usable by strategies/ and by predict/ without a
live run. Nothing here imports strategies/, comm/, cli/ or analysis/."""
