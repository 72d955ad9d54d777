"""What a run is made of at run time: the model, engine, optimizer and precision put together (build.py), one
step's micro-batches through them (step.py), the training loop (trainer.py)."""
