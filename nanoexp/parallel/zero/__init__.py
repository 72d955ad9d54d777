"""ZeRO 0-3 over the ranks that hold the same weights (docs/zero.md). GradientSync (parallel/gradient_sync.py) gives
each chunk an engine (engine.py: ZeroEngine), which cuts its parameters into units (units.py) and runs them on one
path each: accumulated.py (summed over the micro-batches, reduced once a step), scattered.py (ZeRO-2/3: reduce-
scattered after every backward) and gathered.py (ZeRO-3: the weights whole only while their module runs). The
optimizer updates this rank's shard of them (sharded_optimizer.py)."""
