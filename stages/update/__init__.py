"""The update stage (docs/design.md §7): GRPO-C / GRPO policy update with a k3 KL penalty, HF checkpoints.

Modules: ``batching`` (rows, minibatches, micro-batches), ``logprobs`` (response and choice
log-probs), ``loss`` (the objectives), ``trainer`` (optimizer steps), ``checkpoint`` (load/save),
``distributed`` (torchrun DDP/FSDP2), ``runner`` (``run_update``).
"""

from stages.update.runner import run_update

__all__ = ["run_update"]
