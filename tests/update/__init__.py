"""Tests of stages/update/: losses, the trainer, checkpoints, LoRA, torchrun, retention."""
