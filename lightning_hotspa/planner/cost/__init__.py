"""The cost side of planning: the predicted seconds and memory of a layout option (the analytic
model, hardware and runtime profiles, the per-stage terms and timelines, and its calibration against
published runs)."""
