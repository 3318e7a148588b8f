"""Tests of stages/policy/: the tiny model and its tokenizer, the hf and vLLM engines, a real pretrained model."""
