"""Profiled mode: the coefficients fitted to measured stage times and the schedule of which version
plans which step."""
