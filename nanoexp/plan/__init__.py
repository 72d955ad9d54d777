"""Planning: a cost model of a layout's step on a cluster, its time (cost.py, with the collectives of comm.py, the
bytes of traffic.py and the devices of hardware.py) and its memory (memory.py); the search that ranks every valid
layout (search.py; scripts/plan.py, cli.py), make_config's memory-only chooser (chooser.py), and the published
measurements it is checked against (published.py; docs/planning.md)."""
