"""Tools that check rather than run: nothing here is imported by training.

- p2p_plan.py: a pipeline schedule's messages as NCCL sees them, replayed under NCCL's rules (`check`);
- context_parallel.py: the ring attention's message plan and the inverse of the zig-zag split;
- comm_counter.py: the bytes each process group moves, counted by wrapping torch.distributed;
- trace_analysis.py: bubbles and gradient-bucket overlap read from a run's pipeline timeline;
- pipeline_bubble.py: a schedule's idle time simulated from its compute times.
"""
