"""The ONE package that touches vLLM internals. vLLM 0.26 (GPU) and 0.32 (CPU build).

Everything else in ``lens_evals.engine`` talks to vLLM through the functions here:
patch points (request validation, offline/async result delivery, the model runner's
forward, the HTTP app) and accessors (the batch layout, a request's extra args, the
decoder layers, parallel ranks). A vLLM upgrade should only need edits here.

One module per side, each with its ``__all__``; callers name the module, so a reader sees
which side a name belongs to (``compat.frontend.input_processor``, ``compat.worker.batch_layout``):

- ``admission``: the input processor's validation hook, request ids, sampling parameters.
- ``frontend``: the offline ``LLM`` / ``AsyncLLM`` / HTTP app patch points, engine checks.
- ``config``: the engine configuration both sides read (the model's shape, our config section).
- ``rpc``: ``collective_rpc`` between the frontend and the workers.
- ``worker``: the model runner's patch point and accessors (batch layout, layers, ranks).
- ``architectures``: how each decoder-layer class carries the residual stream.
- ``lora``: LoRA kernels and dtypes.

This package re-exports these modules only, no names of theirs.
"""

from lens_evals.engine.compat import admission, architectures, config, frontend, lora, rpc, worker

__all__ = ["admission", "architectures", "config", "frontend", "lora", "rpc", "worker"]
