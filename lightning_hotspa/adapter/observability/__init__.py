"""What a user sees of a run: metrics, callbacks, timelines, W&B and console noise."""
