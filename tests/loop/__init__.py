"""Tests of stages/loop/ and stages/evaluate/: the loop, evaluation, the shipped configs, the quickstart."""
