"""The Inspect AI evals, laid out one folder per eval (task, its own solver / scorer, README):
``roleplaying/``, ``coup/``, ``activation_oracle/``, ``petri_audit/``, ``steering_effect/``; what
several evals use (the capture / steer solvers, the probe solver and scorer, the final-turn
readers, the oracle solver, the provider) is the Inspect layer, :mod:`lens_evals.inspect_kit`. Every ``@task`` is registered through the ``inspect_ai`` entry point
(:mod:`lens_evals.evals._registry`): ``inspect eval lens_evals/roleplaying_probe``. The model API
``vllm-lens/<model>`` is :mod:`lens_evals.inspect_kit.provider`."""
