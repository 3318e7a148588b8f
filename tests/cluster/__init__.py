"""Tests of stages/cluster/: the Ray executor."""
