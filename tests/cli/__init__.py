"""Tests of graft_cli/: what the commands import and print, and one-line errors on hostile input."""
