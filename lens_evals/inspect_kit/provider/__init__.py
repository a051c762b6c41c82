"""The Inspect AI model API ``vllm-lens/<model>`` (registered through the ``inspect_ai`` entry point,
``lens_evals.evals._registry``).

* :mod:`~lens_evals.inspect_kit.provider.api`: :class:`VLLMLensAPI`, the OpenAI-compatible provider;
* :mod:`~lens_evals.inspect_kit.provider.server`: the lens-enabled vLLM server process it starts and shares;
* :mod:`~lens_evals.inspect_kit.provider.xargs`: Inspect ``extra_args`` -> vLLM ``vllm_xargs`` (through
  :func:`lens_evals.client.lens_xargs`);
* :mod:`~lens_evals.inspect_kit.provider.outputs`: what a lens request leaves in ``ModelOutput.metadata``, and
  the one way solvers read it (:func:`~lens_evals.inspect_kit.provider.outputs.output_activations`);
* :mod:`~lens_evals.inspect_kit.provider.logged_call`: what Inspect's log keeps of a request (arrays as digests);
* :mod:`~lens_evals.inspect_kit.provider.lora_args`: server flags for LoRA adapters.

Nothing is imported here, so ``lens_evals.inspect_kit.provider.server`` needs neither Inspect nor openai."""
