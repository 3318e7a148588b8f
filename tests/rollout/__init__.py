"""Tests of stages/rollout/ and stages/play/: steps tables, modes, seeds, the runner, shards."""
