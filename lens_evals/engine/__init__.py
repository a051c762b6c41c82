"""The part of lens-evals that runs inside vLLM's processes (installed by ``plugin.register``).

Packages by process side (``README.md`` here follows one request through them;
docs/architecture.md has the picture of the data path):

- ``compat/``: the one door to vLLM's internals (patch points, accessors, layer contracts).
- ``frontend/``: the process that holds ``LLM`` / ``AsyncLLM`` / the API server: ``state``
  (``LensFrontendState``, one per engine), ``admit`` (validate, normalise), ``pending``,
  ``attach`` (fetch, attach), ``rows``, ``hooks``, ``hook_set_store`` / ``hook_sets``,
  ``hook_routes``, ``vllm_lens_api``, ``http_middleware``, ``budget``, ``fetch_batch``,
  ``self_check`` / ``self_check_run``, ``offline`` (the package's own ``LLM`` starter).
- ``transport/``: what crosses between the two and is read by both: ``protocol`` (method names,
  ``LensRequestWire``, fetch results, packed rows), ``handoff`` / ``handoff_pool`` /
  ``handoff_files`` (shared-memory rows), ``hook_refs``, ``probe_cache`` (probes encoded /
  decoded once), ``graph_layers`` (graph mode's configuration), ``timing``.
- ``worker/``: the model runner's process: ``state`` (per model runner) around ``core``
  (``ledger``, ``planners`` -> ``plan``, ``step_stores`` -> ``host_copy`` / ``host_store``, the
  fetch), ``taps`` / ``graph_taps``, ``requests``, ``hooks``, ``transfer``, ``results``, ``rpc``.
- ``plugin``: vLLM's entry point, wiring both sides into vLLM through ``compat``.
"""
