"""Acceleration: what this machine can run, the plan chosen for it, and the speed variants
behind that plan."""
