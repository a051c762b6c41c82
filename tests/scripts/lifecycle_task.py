"""A two-sample capture task for the provider lifecycle test (run with `inspect eval`)."""

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import match

from lens_evals.inspect_kit.lens_solvers import capture_activations


@task
def lifecycle() -> Task:
    samples = [Sample(input="the cat reads a book.", target="x"), Sample(input="my friend", target="y")]
    return Task(dataset=samples, solver=[capture_activations([0, 3])], scorer=match(), config=GenerateConfig(max_tokens=4, temperature=0.0))
