"""Steering eval: a dose-response sweep of a contrastive steering vector over layers and scales."""

from lens_evals.evals.steering_effect.steering_effect import steering_effect, steering_effect_task

__all__ = ["steering_effect", "steering_effect_task"]
