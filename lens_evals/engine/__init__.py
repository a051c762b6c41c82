"""The part of lens-evals that runs inside vLLM's processes (installed by ``plugin.register``).

Modules by side (docs/architecture.md has the picture of the data path):

- ``compat/``: the one door to vLLM's internals (patch points, accessors, layer contracts).
- ``protocol``: everything that crosses between frontend and worker (method names, payloads,
  fetch results, packed rows).
- frontend side: ``frontend_admit`` (validate, normalise), ``frontend_attach`` (fetch, attach),
  ``frontend_rows``, ``frontend_hooks``, ``hook_sets``, ``hook_routes``, ``vllm_lens_api``,
  ``http_middleware``.
- both sides: ``hook_refs``, ``handoff``, ``handoff_pool``, ``probe_cache`` (probes encoded /
  decoded once), ``timing``.
- worker side: ``worker_state`` (per model runner) around ``worker_core`` (``ledger``,
  ``planners`` -> ``plan``, ``step_stores`` -> ``host_copy`` / ``host_store``, the fetch), ``taps`` /
  ``graph_taps``, ``requests``, ``worker_hooks``, ``transfer``, ``results``, ``worker_rpc``.
"""
