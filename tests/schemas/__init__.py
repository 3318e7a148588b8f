"""Tests of schemas/: the tables, the config, the run directory, manifests, checksums, the run lock, recomputes."""
