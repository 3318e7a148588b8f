"""Tests of stages/envs/: the environments, plug-ins, prompts and parsing, graft play."""
