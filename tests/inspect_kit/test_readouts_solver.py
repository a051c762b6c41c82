"""The ``lens_readouts`` solver end to end: one Inspect eval on the tiny Llama through the
``vllm-lens`` provider (one server for the module) leaves the response's readouts in the log's
``EvalSample.output.metadata``; they equal a client-side computation (``lens_evals.readouts.reference``
with HF transformers' own final norm and unembedding, and the SAE's file) applied to a capture of
the same prompt and response tokens, within the bounds of ``tests/tolerance.py``; the report shows
them; bad readout input is a clear error."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from inspect_ai import Task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.log import EvalLog, read_eval_log, write_eval_log
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import Generate, Solver, TaskState, chain, generate, solver

from lens_evals import LinearProbe
from lens_evals.client import LensClient
from lens_evals.inspect_kit.provider.server import LensServer
from lens_evals.inspect_kit.readouts_solver import lens_readouts
from lens_evals.readouts import reference
from lens_evals.readouts.sae_files import SaeWeights, load_sae, save_sae
from lens_evals.report import ReportError, write_report
from lens_evals.report.readouts import shown, visible
from lens_evals.request.readouts import SaeEncoder, SaeReadout
from lens_evals.request.spec import CAPTURE_KEY, PROBE_KEY
from tests.conftest import TINY_PROMPTS, engine_options
from tests.engine.test_readouts import assert_topk_close, hf_head
from tests.tolerance import assert_scores_close, assert_stream_close, stream_bound

LENS_LAYERS, SAE_LAYER, TOP_K, SAE_TOP_K, MAX_TOKENS = [0, 2, 3], 2, 4, 5, 5
PROMPTS = TINY_PROMPTS[:2]


@pytest.fixture(scope="module")
def tiny_server(tiny_path: Path):
    server = LensServer(str(tiny_path), served_name="tiny-llama", server_args=engine_options()).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory) -> Path:
    rng = np.random.default_rng(7)
    n, d = 48, 128
    sae = SaeWeights(
        W_enc=(rng.normal(size=(d, n)) / np.sqrt(d)).astype(np.float32),
        b_enc=(0.1 * rng.normal(size=n)).astype(np.float32),
        W_dec=rng.normal(size=(n, d)).astype(np.float32),
        b_dec=rng.normal(size=d).astype(np.float32),
        architecture="standard",
        layer=SAE_LAYER,
    )
    return save_sae(tmp_path_factory.mktemp("sae") / "sae-l2", sae, model="tiny-llama")


def tokenize(server: LensServer, messages: list[dict[str, str]]) -> list[int]:
    """The served chat's prompt token ids, as the server's own /tokenize makes them."""
    body = {"model": "tiny-llama", "messages": messages, "add_generation_prompt": True}
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    response = httpx.post(f"{server.url}/tokenize", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return [int(t) for t in response.json()["tokens"]]


def run(server: LensServer, solver: Any, log_dir: Path) -> EvalLog:
    samples = [Sample(input=p, target="x", id=f"s{i}") for i, p in enumerate(PROMPTS)]
    task = Task(dataset=samples, solver=[solver], config=GenerateConfig(max_tokens=MAX_TOKENS, temperature=0.0))
    (log,) = inspect_eval(task, model="vllm-lens/tiny-llama", model_base_url=f"{server.url}/v1", log_dir=str(log_dir), display="none")
    return log


@pytest.fixture(scope="module")
def readouts_log(tiny_server, sae_dir, tmp_path_factory) -> EvalLog:
    solver = lens_readouts(lens="logit", sae=sae_dir, layers=LENS_LAYERS, top_k=TOP_K, sae_top_k=SAE_TOP_K, extra_body={"ignore_eos": True})
    log = run(tiny_server, solver, tmp_path_factory.mktemp("logs"))
    assert log.status == "success", log.error
    return read_eval_log(log.location)  # what the .eval file holds


def test_logged_readouts_equal_the_reference_on_a_capture(readouts_log, tiny_server, tiny_path, sae_dir) -> None:
    client = LensClient(tiny_server.url, "tiny-llama", api_key=tiny_server.api_key)
    norm, unembed, _ = hf_head(tiny_path)
    sae = load_sae(sae_dir)
    for sample in readouts_log.samples:
        got = sample.output.metadata["readouts"]
        assert "activations" not in sample.output.metadata and "token_ids" not in sample.output.metadata
        response, lens, latents = got["response"], got["lens"]["logit"], got["sae"]["sae"]
        n = len(response["token_ids"])
        assert n == MAX_TOKENS and "".join(response["tokens"]) == sample.output.completion
        prompt_ids = tokenize(tiny_server, [{"role": "user", "content": sample.input}])
        assert response["positions"] == [len(prompt_ids) - 1 + j for j in range(n)]
        # the last layer's logit lens is the model's own next-token choice: greedy took its top-1
        assert [row[0] for row in lens["token_ids"][-1]] == response["token_ids"]
        assert {int(i) for i in got["token_texts"]} == {i for layer in lens["token_ids"] for row in layer for i in row}
        # the reference: the same tokens prefilled in one request, its stream captured, read on the host
        captured = client.generate(prompt_ids + response["token_ids"], max_tokens=1, capture_layers=LENS_LAYERS)  # type: ignore[arg-type]
        stream = torch.as_tensor(captured.activations["residual_stream"]).float()[:, response["positions"]]  # type: ignore[index]
        assert lens["layers"] == LENS_LAYERS
        for row, layer in enumerate(LENS_LAYERS):
            ref = reference.lens_logprobs(stream[row], layer, norm, unembed)
            bound = 2 * stream_bound() * unembed.norm(dim=-1).max() * norm(stream[row]).norm(dim=-1)
            ids, values = torch.tensor(lens["token_ids"][row]), torch.tensor(lens["logprobs"][row])
            assert_topk_close(ids, values, ref, bound, f"sample {sample.id} layer {layer}")
        want = reference.sae_topk(stream[LENS_LAYERS.index(SAE_LAYER)], sae, SAE_TOP_K)
        h = stream[LENS_LAYERS.index(SAE_LAYER)].double()
        bound_sae = stream_bound() * np.linalg.norm(sae.W_enc, axis=0).max() * (h.norm(dim=-1) + np.linalg.norm(sae.b_dec)).numpy()
        values, ids = np.asarray(latents["values"]), np.asarray(latents["latent_ids"])
        assert latents["layer"] == SAE_LAYER and values.shape == (n, SAE_TOP_K)
        assert np.all(np.abs(values - want["values"]) <= bound_sae[:, None] + 1e-6)
        clear = np.abs(want["values"][:, :-1] - want["values"][:, 1:]).min(axis=-1) > 2 * bound_sae  # no near-ties: ids match
        assert clear.sum() > 0 and np.array_equal(ids[clear], want["latent_ids"][clear])


class _Cells(HTMLParser):
    """(sample, readout, layer or None, token index) -> (title, text) of every readout cell."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[tuple[str, str, int | None, int], list[str]] = {}
        self.where: dict[str, Any] = {}
        self.open: tuple[str, str, int | None, int] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "article" and a.get("data-sample"):
            self.where = {"sample": a["data-sample"]}
        elif tag == "table" and a.get("data-readout"):
            self.where = {**self.where, "readout": a["data-readout"], "layer": None}
        elif tag == "tr":
            self.where["layer"] = int(a["data-layer"]) if a.get("data-layer") else None
        elif tag == "td" and a.get("data-token") is not None and "readout" in self.where:
            self.open = (self.where["sample"], self.where["readout"], self.where["layer"], int(a["data-token"]))
            self.cells[self.open] = [a.get("title") or "", ""]

    def handle_data(self, data: str) -> None:
        if self.open is not None:
            self.cells[self.open][1] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self.open = None


def test_report_shows_each_tokens_lens_and_latents(readouts_log, tmp_path) -> None:
    html = write_report(readouts_log.location, tmp_path / "report.html").read_text()
    parser = _Cells()
    parser.feed(html)
    assert 'class="readouts"' in html and "<script" not in html
    for sample in readouts_log.samples:
        got = sample.output.metadata["readouts"]
        texts, lens = got["token_texts"], got["lens"]["logit"]
        for row, layer in enumerate(lens["layers"]):
            for j, ids in enumerate(lens["token_ids"][row]):
                title, text = parser.cells[(str(sample.id), "logit", layer, j)]
                assert text == visible(texts[str(ids[0])])  # the top token's text (the parser unescapes)
                assert all(repr(texts[str(i)]) in title for i in ids)  # the top-k, each with its probability
        for j, (ids, values) in enumerate(zip(got["sae"]["sae"]["latent_ids"], got["sae"]["sae"]["values"])):
            title, _ = parser.cells[(str(sample.id), "sae", None, j)]
            assert title == (", ".join(f"{i} {v:.3f}" for i, v in zip(ids, values) if i >= 0 and v > 0) or "no active latent")
    assert all(shown(t) in html for s in readouts_log.samples for t in s.output.metadata["readouts"]["response"]["tokens"] if t.strip())


def test_a_malformed_readout_log_is_a_report_error(readouts_log, tmp_path) -> None:
    log = readouts_log.model_copy(deep=True)
    log.samples[0].output.metadata["readouts"]["lens"]["logit"]["token_ids"].pop()
    write_eval_log(log, str(tmp_path / "bad.eval"))
    with pytest.raises(ReportError, match="lens readout 'logit' is not"):
        write_report(tmp_path / "bad.eval", tmp_path / "bad.html")


@solver
def _keep_output(into: dict[str, dict[str, Any]]) -> Solver:
    """Record each sample's output metadata as the next solver or scorer sees it (the .eval log
    cannot hold tensors: they are None there)."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        into[str(state.sample_id)] = dict(state.output.metadata or {})
        return state

    return solve


def test_a_probe_and_a_capture_asked_beside_the_readouts_reach_the_sample_as_without_the_solver(tiny_server, tmp_path) -> None:
    """The solver takes only its readouts out of the output: probe scores and a capture asked for
    in the same generate's extra_args reach the sample as a plain generate with that request
    leaves them (and the token ids of their rows)."""
    probe = LinearProbe(name="p", layer=2, weights=np.random.default_rng(3).normal(size=128).astype(np.float32), bias=0.5)
    body = {"ignore_eos": True, "extra_args": {PROBE_KEY: [probe], CAPTURE_KEY: [2]}}
    seen: dict[str, dict[str, dict[str, Any]]] = {"readouts": {}, "plain": {}}
    solvers = {"readouts": lens_readouts(layers=[3], top_k=2, extra_body=body), "plain": generate(extra_body=body)}
    logs = [run(tiny_server, chain(solver, _keep_output(seen[name])), tmp_path / name) for name, solver in solvers.items()]
    assert all(log.status == "success" for log in logs), [log.error for log in logs]
    assert sorted(seen["readouts"]) == sorted(seen["plain"]) == ["s0", "s1"]
    for sample, got in seen["readouts"].items():
        want = seen["plain"][sample]
        assert "readouts" in got and set(got) - {"readouts"} == set(want)
        assert got["token_ids"] == want["token_ids"]  # the rows' tokens
        activations, expected = got["activations"], want["activations"]
        assert set(activations) == set(expected) == {"probe_scores", "residual_stream"}
        stream, reference = activations["residual_stream"][0].float(), expected["residual_stream"][0].float()
        assert reference.shape[0] == len(want["token_ids"]["prompt"]) + MAX_TOKENS - 1
        assert_stream_close(stream, reference, f"sample {sample}: the capture")
        scores = activations["probe_scores"]["p"], expected["probe_scores"]["p"]
        assert_scores_close(*scores, torch.from_numpy(probe.weights), reference, f"sample {sample}: the probe", bias=0.5)


def test_a_readout_the_model_cannot_serve_fails_the_sample_saying_why(tiny_server, tmp_path) -> None:
    log = run(tiny_server, lens_readouts(layers=[9]), tmp_path)  # the tiny Llama has 4 layers
    assert log.status == "error" and log.error is not None
    assert "out of range: the model has 4 layers" in log.error.message


def test_bad_readout_arguments_are_refused_when_the_solver_is_made(tmp_path) -> None:
    cases = {
        "nothing asked": ({"lens": None}, "give a lens, an SAE or both"),
        "top_k": ({"top_k": 0}, r"lens_readouts\(lens=...\).*top_k"),
        "missing SAE": ({"sae": tmp_path / "nowhere"}, r"lens_readouts\(sae=...\).*nowhere"),
        "one name twice": (
            {"sae": SaeReadout(name="logit", layer=0, sae=SaeEncoder(W_enc=np.eye(2), b_enc=np.zeros(2)))},
            "share the name",
        ),
        "missing lens file": ({"lens": tmp_path / "lens.safetensors"}, r"lens_readouts\(lens=...\).*lens.safetensors"),
    }
    for name, (args, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            lens_readouts(**args)
            pytest.fail(f"{name}: accepted")
