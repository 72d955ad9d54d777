"""Planning: a cost model of a layout's step time and memory on a cluster (cost.py, with the bytes of traffic.py
and the devices of hardware.py), the search that ranks every valid layout (search.py; scripts/plan.py), and
the published measurements it is checked against (published.py; docs/planning.md)."""
