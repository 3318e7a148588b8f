"""A start-up hook for the Python processes vLLM starts (its engine core, workers and model-inspection
subprocess): ``stages.policy.vllm_engine`` puts this folder first on their ``PYTHONPATH``, so Python
runs ``sitecustomize.py`` from here before any of their imports: it hides a torch extension that
cannot load beside the installed torch (stages/policy/torch_extensions.py says why) and keeps vLLM's
import-time notices at ``VLLM_LOGGING_LEVEL`` (stages/policy/quiet.py)."""
