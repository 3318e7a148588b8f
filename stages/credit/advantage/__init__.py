"""Step-credit estimators: one registry, name -> function (like verl's core_algos).

Every estimator has the signature ``(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput``
and its equation in its docstring. ``compute_advantages`` runs one by name and returns the
advantages table. Importing the package registers the built-in estimators (``graft``, the
baselines, ``graphmc`` and the bench oracle ``oracle``).
"""

from stages.credit.advantage import baselines, graft, graph_mc, oracle  # noqa: F401  (their @register decorators run)
from stages.credit.advantage.registry import ESTIMATORS, CreditInputs, CreditOutput, get_estimator, register

__all__ = ["ESTIMATORS", "CreditInputs", "CreditOutput", "get_estimator", "register"]
