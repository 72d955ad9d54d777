"""What a run measures while it runs, importing nothing else of nanoexp, so that parallel/ and runtime/ may use
it: the heartbeat, the pipeline trace, the step's end (timing), memory as measured, the profiler, MoE step metrics,
the flight recorder's dumps and the stall diagnosis read from them. The reports built on them sit in observe/."""
