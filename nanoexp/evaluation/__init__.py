"""Downstream evaluation: lm-evaluation-harness tasks on the sharded model, in the loop and offline
(docs/evaluation.md)."""
