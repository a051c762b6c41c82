"""The steering eval (lens_evals/steering_effect) end to end through the vllm-lens provider on the
tiny Llama: a planted direction (the unembedding row of one token, added after the last layer)
raises that token's teacher-forced log-probability monotonically with the scale, and the
mean-difference vector the eval computes through the server equals one computed from the tests'
own offline engine's captures of the same contrast prompts."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from inspect_ai import eval as inspect_eval
from inspect_ai.log import read_eval_log
from safetensors.numpy import load_file

from lens_evals.cli.app import main as cli
from lens_evals.evals.steering_effect import steering_effect_task
from lens_evals.evals.steering_effect.concepts import Concept, Item, words
from lens_evals.evals.steering_effect.measures import continuation_logprobs, perplexity, word_balance
from lens_evals.evals.steering_effect.steering_effect import number_list
from tests.conftest import capture, greedy

SCALES = [0.0, 2.0, 4.0, 8.0, 16.0]
PLANTED_LAYER = 3  # the tiny Llama's last layer: the row then reaches the unembedding through the final norm only
TRUTH, RIVER = 371, 356  # " truth", " river" in the tiny Llama's tokenizer


def planted_concept() -> Concept:
    prompts = [[{"role": "user", "content": text}] for text in ("the cat reads a book.", "my friend", "a student likes the answer")]
    return Concept(
        name="planted",
        positive_prompts=prompts[:1],
        negative_prompts=prompts[1:2],
        items=[Item(messages=p, answer_prefix="the", positive=" truth", negative=" river") for p in prompts],
        positive_words=frozenset({"truth"}),
        negative_words=frozenset({"river"}),
    )


def contrast_concept() -> Concept:
    """Two contrast pairs of the tiny tokenizer's words; two items."""
    ask = [[{"role": "user", "content": text}] for text in ("the truth", "a model finds the truth.", "my friend", "the cat reads a book.")]
    items = [Item(messages=ask[0], answer_prefix="the", positive=" truth", negative=" river")] * 2
    return Concept(name="contrast", positive_prompts=ask[:2], negative_prompts=ask[2:], items=items)


def test_planted_direction_and_mean_difference_end_to_end(tiny_path, llm, tmp_path) -> None:
    unembedding = load_file(str(tiny_path / "model.safetensors"))["lm_head.weight"]
    planted = unembedding[TRUTH] / np.linalg.norm(unembedding[TRUTH])
    tasks = [
        steering_effect_task(planted_concept(), [PLANTED_LAYER], SCALES, prompts=3, max_tokens=6, vector=planted),
        steering_effect_task(contrast_concept(), [1, 2], [0.0, 3.0], prompts=2, max_tokens=4),
    ]
    logs = inspect_eval(tasks, model="vllm-lens/tiny-llama", log_dir=str(tmp_path / "logs"), display="none", max_tasks=1)
    assert [log.status for log in logs] == ["success"] * 2, [log.error for log in logs]
    check_planted(logs[0])
    check_mean_difference(logs[1], llm, contrast_concept())
    check_report(Path(logs[0].location), tmp_path / "steering.html")


def check_report(log_path: Path, page: Path) -> None:
    """``lens-evals report`` on the planted log, rendered by chromium: the three dose-response
    figures, one steered text per sample, and the table's means equal to the log's."""
    assert cli(["report", str(log_path), "--out", str(page)]) == 0
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: scripts/setup.sh installs Debian's chromium"
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180
    ).stdout
    for measure in ("logprob_diff", "word_balance", "perplexity"):
        assert f'id="dose-{measure}"' in dom and "layer 3" in dom
    log = read_eval_log(str(log_path))
    assert dom.count('class="transcript steered"') == len(log.samples) == 15
    for scale in SCALES:
        chosen = [s.scores["steering_scorer"].value["logprob_diff"] for s in log.samples if s.metadata["scale"] == scale]
        assert f"<tr><td>3</td><td>{scale:g}</td><td>{scale:.3f}</td><td>3</td><td>{np.mean(chosen):.3f}</td>" in dom  # unit vector


def check_planted(log) -> None:
    scores = [s.scores["steering_scorer"] for s in log.samples]
    assert len(scores) == 3 * len(SCALES)
    for item in range(3):
        rows = sorted((s.metadata for s in scores if s.metadata["item"] == item), key=lambda m: m["scale"])
        assert [m["scale"] for m in rows] == SCALES
        truth = [m["logprob_positive"] for m in rows]
        assert all(b > a for a, b in zip(truth, truth[1:])), f"log P(truth) not rising with scale: {truth}"
        diff = [m["logprob_positive"] - m["logprob_negative"] for m in rows]
        assert all(b > a for a, b in zip(diff, diff[1:])), f"log P(truth) - log P(river) not rising: {diff}"
        assert truth[-1] - truth[0] > 3.0, truth  # a clear rise, not noise (a 512-token vocabulary: it starts near log 1/512)
        for m in rows:
            assert m["vector_norm"] == pytest.approx(1.0, rel=1e-5)
            found = words(m["text"])
            expected = (found.count("truth") - found.count("river")) / len(found) if found else 0.0
            assert m["word_balance"] == pytest.approx(expected)
            assert m["perplexity"] >= 1.0 if m["text"].strip() else math.isnan(m["perplexity"])
    steered = sorted((s for s in scores), key=lambda s: s.metadata["scale"])[-1]
    assert "truth" in words(steered.answer), steered.answer  # at the largest scale the steered text says it
    sample = log.samples[0]
    assert sample.messages[-1].role == "assistant" and sample.messages[-1].text.startswith("the")


def check_mean_difference(log, llm, concept: Concept) -> None:
    """The eval's vector norm per layer equals the mean difference of offline last-token captures."""
    params = greedy(1, output_residual_stream=[1, 2])
    rows = []
    for prompt in concept.positive_prompts + concept.negative_prompts:
        (output,) = llm.chat(prompt, params, use_tqdm=False)
        stream = capture(output).float().numpy()  # (n_layers, n_positions, hidden)
        rows.append(stream[:, len(output.prompt_token_ids) - 1])
    expected = np.mean(rows[:2], axis=0) - np.mean(rows[2:], axis=0)
    for sample in log.samples:
        meta = sample.scores["steering_scorer"].metadata
        assert meta["vector_norm"] == pytest.approx(float(np.linalg.norm(expected[[1, 2].index(meta["layer"])])), rel=1e-3)
    assert [s.name for s in log.results.scores] == ["logprob_diff", "perplexity"]  # no word lists: no word_balance


def test_measures_by_hand() -> None:
    concept = planted_concept()
    assert word_balance("The truth, the TRUTH and a river.", concept) == pytest.approx((2 - 1) / 7)
    assert word_balance("...", concept) == 0.0
    assert perplexity([math.log(0.5), math.log(0.25)]) == pytest.approx(math.sqrt(8))
    # prompt ids [1, 2, 3, 4, 5] after a prefix tokenised [1, 2, 9]: the last token of the prefix merged
    assert continuation_logprobs([None, -1.0, -2.0, -3.0, -4.0], [1, 2, 3, 4, 5], [1, 2, 9]) == [-2.0, -3.0, -4.0]
    with pytest.raises(ValueError, match="no token"):
        continuation_logprobs([None, -1.0], [1, 2], [1, 2])
    assert number_list("0, 2,4.5", float, "scales") == [0.0, 2.0, 4.5]
    with pytest.raises(ValueError, match="none twice"):
        number_list("1,1", int, "layers")
    with pytest.raises(ValueError, match="comma list"):
        number_list("a,b", int, "layers")
