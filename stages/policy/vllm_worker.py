"""What graft runs inside vLLM's worker processes, through vLLM's worker-extension hook: the engine is
built with ``LLM(worker_extension_cls="stages.policy.vllm_worker.WorkerExtension")`` and calls these
methods with ``LLM.collective_rpc(name, ...)`` (vLLM's documented pattern for RL weight updates)."""

from __future__ import annotations


class WorkerExtension:
    """Mixed into each vLLM worker (``self`` is the worker)."""

    def graft_reload_weights(self, weights_path: str) -> None:
        """Load the safetensors of the model directory ``weights_path`` into the running model.

        The worker's ``reload_weights`` re-processes every layer it loads. On vLLM's CPU backend that
        processing packs each projection's weight for oneDNN; a language-model head tied to the input
        embeddings is not loaded (it shares their weight), so it would keep computing logits from the
        previous model's packed copy. Its processing is rerun from the reloaded embedding weight (a
        no-op on GPU, where the head reads the shared weight directly).
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        self.reload_weights(weights_path=weights_path)
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(module, VocabParallelEmbedding) and hasattr(
                method, "process_weights_after_loading"
            ):
                method.process_weights_after_loading(module)
