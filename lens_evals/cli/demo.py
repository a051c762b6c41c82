"""Capture-and-steer demo on the embedded default model (the README's main job, until the
probe suite lands): build a steering vector from captured activations (mean difference of two
contrasting prompt sets), then generate with and without it in one dynamic batch."""

from __future__ import annotations

import argparse
import time
from typing import Any

from lens_evals.cli.checks import check_layer, layer_index, model_name_or_dir
from lens_evals.engine.frontend.offline import add_engine_arg_option, parse_engine_args

HELP = "capture and steer on the embedded default model"

POSITIVE = ["I love this, what a wonderful day!", "This is fantastic news, I am so happy.", "What a delightful surprise, thank you!"]
NEGATIVE = ["I hate this, what a terrible day.", "This is awful news, I am so sad.", "What a horrible surprise, how dreadful."]
QUESTIONS = ["Tell me about your weekend.", "How do you feel about Mondays?", "Describe the weather today."]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=model_name_or_dir, default="smollm2-135m-instruct")
    parser.add_argument("--layer", type=layer_index, default=15)
    parser.add_argument("--scale", type=float, default=8.0, help="steering strength in percent of ||h||")
    add_engine_arg_option(parser)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_layer(parser, args.model, args.layer)
    return run_demo(args.model, args.layer, args.scale, engine_args=parse_engine_args(args.engine_arg))


def run_demo(model: str, layer: int, scale: float, engine_args: dict[str, Any] | None = None) -> int:
    import torch
    from vllm import SamplingParams

    from lens_evals import SteeringVector
    from lens_evals.engine.frontend.offline import engine_for
    from lens_evals.models.registry import resolve_model
    from lens_evals.request.wire_model import float32_array

    path = resolve_model(model)
    started = time.perf_counter()
    with engine_for(path, engine_args={"dtype": "float32", **(engine_args or {})}) as llm:
        print(f"engine ready in {time.perf_counter() - started:.1f} s ({path})")
        capture = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"output_residual_stream": [layer]})
        outputs = llm.generate(POSITIVE + NEGATIVE, capture, use_tqdm=False)
        means = [torch.stack([o.activations["residual_stream"][0].mean(0) for o in group]).mean(0) for group in (outputs[:3], outputs[3:])]
        direction = float32_array(means[0] - means[1])
        print(
            f"captured layer {layer}: {len(outputs)} prompts, hidden {direction.shape[0]}; ||pos - neg|| = {float((means[0] - means[1]).norm()):.2f}"
        )

        vector = SteeringVector(activations=direction[None, :], layer_indices=[layer], scale=scale / 100, norm_match=True)
        plain = SamplingParams(max_tokens=30, temperature=0.0)
        steered = SamplingParams(max_tokens=30, temperature=0.0, extra_args={"apply_steering_vectors": [vector]})
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
        results = llm.chat(conversations + conversations, [plain] * 3 + [steered] * 3, use_tqdm=False)
    for i, question in enumerate(QUESTIONS):
        print(f"\nQ: {question}\n  plain  : {results[i].outputs[0].text.strip()!r}\n  steered: {results[i + 3].outputs[0].text.strip()!r}")
    changed = sum(results[i].outputs[0].text != results[i + 3].outputs[0].text for i in range(3))
    print(f"\nsteering (norm_match, scale {scale / 100}) changed {changed}/3 answers in the same batch as the plain ones")
    return 0
