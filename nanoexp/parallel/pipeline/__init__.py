"""Pipeline parallelism: the schedules of the engines as data (schedules.py) and the executor that runs them
(engine.py)."""
from nanoexp.parallel.pipeline.engine import PipelineEngine
from nanoexp.parallel.pipeline.schedules import SCHEDULES, schedule
