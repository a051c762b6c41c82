"""``lens-evals bench``: the same generation work through pure vLLM, our plugin's features and the
tools users would pick instead (HF transformers + hook, nnsight, TransformerLens), each system in
its own process. See :mod:`benchmarks.launcher` for the flow."""
