"""``from stages.synth import synth_steps`` keeps working (the README's path): the synthetic MDP
rollouts live in the credit room, ``stages/credit/synth.py``."""

from stages.credit.synth import synth_steps, write_synth

__all__ = ["synth_steps", "write_synth"]
