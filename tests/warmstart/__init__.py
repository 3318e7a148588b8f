"""Tests of stages/warmstart/: expert demos, behaviour cloning, DAgger, the warm start's own rooms."""
