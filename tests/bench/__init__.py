"""Tests of the bench/ scripts' own arithmetic."""
