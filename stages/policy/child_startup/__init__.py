"""A start-up hook for the Python processes vLLM starts (its engine core, workers and model-inspection
subprocess): when a torch extension cannot load beside the installed torch, ``stages.policy.vllm_engine``
puts this folder first on their ``PYTHONPATH``, so Python runs ``sitecustomize.py`` from here before
any of their imports (stages/policy/torch_extensions.py says why)."""
