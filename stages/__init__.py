"""graft: GRAFT step-level credit assignment for agentic RL, as a CLI pipeline over Parquet tables."""

from stages.policy.torch_extensions import hide_mismatched_extensions

__version__ = "0.1.0"

# before anything imports transformers (which imports an installed torchvision whenever it can)
hide_mismatched_extensions()
