"""The optimizers as data and updates, below validation and the runtime: their registry (`OPTIMIZERS` in
registry.py, each entry with its facts), Muon's update (muon.py), the learning-rate schedule (schedule.py) and a
config's table of rates (lr_table.py). A run's optimizer is built from them by nanoexp/runtime/optim.py."""
