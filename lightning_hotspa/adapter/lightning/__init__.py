"""The Lightning seam: the strategy and what it needs around the engine in a Trainer."""
