"""Tests of stages/observe/: reports, graph drawings, SQL over a run, live logging and progress."""
