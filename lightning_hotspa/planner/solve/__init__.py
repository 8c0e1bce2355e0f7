"""The solver: the documents of one mini-batch to options, micro-batches and dp groups at the least
predicted step time (planner/README.md states the objective)."""
