"""Tests of stages/credit/: trajectory graphs, Bellman values, the estimators, diagnostics, synthetic rollouts, the credit commands."""
