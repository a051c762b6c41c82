"""Readouts on the worker (``output_readouts``) against an independent computation on the host:
each request also captures the layers it reads, and the test applies HF transformers' own final
norm and unembedding (and Gemma 2's soft-capping, written out here) in float32 to the captured
stream; SAE latents by numpy from the same capture. Plus: the last layer's logit lens top-1 is
the engine's own greedy token, a planted SAE latent fires exactly where its direction was
steered in, and weights sent once are found again by their digest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lens_evals.request.readouts import AffineLens, LensReadout, SaeEncoder, SaeReadout
from tests.conftest import TINY_PROMPTS, greedy, make_llm
from tests.tolerance import stream_bound

PROMPTS = TINY_PROMPTS[:3]
HIDDEN = 128
LAYERS = 4


def hf_head(path: Path) -> tuple[Any, torch.Tensor, float | None]:
    """(the HF model's final norm, its unembedding (vocab, hidden), its final soft-cap), float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model.model.norm, model.lm_head.weight.detach().float(), getattr(model.config, "final_logit_softcapping", None)


def reference_logprobs(stream: torch.Tensor, head: tuple[Any, torch.Tensor, float | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (..., vocab), the per-row bound on their error): a relative stream error of
    ``stream_bound()`` after the norm moves logit i by at most ||w_i|| * that * ||n||, log_softmax
    at most twice the largest logit move (soft-capping is 1-Lipschitz)."""
    norm, unembed, cap = head
    with torch.no_grad():
        normed = norm(stream.float())
        logits = normed @ unembed.T
        if cap:
            logits = torch.tanh(logits / cap) * cap
    bound = 2 * stream_bound() * unembed.norm(dim=-1).max() * normed.norm(dim=-1)
    return torch.log_softmax(logits, dim=-1), bound


def assert_topk_close(ids: torch.Tensor, values: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """The worker's values equal the reference's at the worker's ids, and are the reference's
    top-k values (so its ids are a top-k up to ties within the bound)."""
    k = ids.shape[-1]
    at_ids = ref.gather(-1, ids.long())
    ref_top = ref.topk(k, dim=-1).values
    for name, got in (("values at the worker's ids", at_ids), ("top-k values", ref_top)):
        excess = ((values - got).abs() - bound[..., None]).max()
        assert excess <= 0, f"{what}: {name} differ by more than the bound (by {float(excess):.3e} over it)"


def capture_and_read(llm: Any, readouts: list[Any], tokens: int = 4, prompts: list[str] = PROMPTS) -> list[Any]:
    return llm.generate(prompts, greedy(tokens, output_residual_stream=True, output_readouts=readouts), use_tqdm=False)


@pytest.fixture(scope="module")
def llm(tiny_path: Path):
    with make_llm(tiny_path) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny_head(tiny_path: Path):
    return hf_head(tiny_path)


def test_logit_lens_equals_hf_head_on_the_capture(llm, tiny_head) -> None:
    outs = capture_and_read(llm, [LensReadout(name="logit", layers="all", top_k=5)])
    for n, out in enumerate(outs):
        got = out.activations["readouts"]["logit"]
        assert got["layers"] == list(range(LAYERS))
        stream = out.activations["residual_stream"]  # (layers, positions, hidden)
        assert got["token_ids"].shape == (LAYERS, stream.shape[1], 5) and got["token_ids"].dtype == torch.int32
        ref, bound = reference_logprobs(stream, tiny_head)
        assert_topk_close(got["token_ids"], got["logprobs"], ref, bound, f"prompt {n}")
        # the last layer's lens is the model's own next-token distribution: greedy picks its top-1
        generated = out.outputs[0].token_ids
        prompt_len = len(out.prompt_token_ids)
        assert got["token_ids"][-1, prompt_len - 1 :, 0].tolist() == list(generated[: stream.shape[1] - prompt_len + 1])


def test_affine_lens_equals_host_translation(llm, tiny_head) -> None:
    rng = np.random.default_rng(3)
    layers = [1, 2]
    weights = np.eye(HIDDEN, dtype=np.float32)[None] + 0.1 * rng.normal(size=(2, HIDDEN, HIDDEN)).astype(np.float32)
    biases = rng.normal(size=(2, HIDDEN)).astype(np.float32)
    lens = AffineLens(layers=layers, weights=weights, biases=biases)
    (out,) = capture_and_read(llm, [LensReadout(name="tuned", layers=layers, top_k=4, lens=lens)], prompts=PROMPTS[:1])
    got = out.activations["readouts"]["tuned"]
    stream = out.activations["residual_stream"][layers]
    translated = torch.einsum("lth,lkh->ltk", stream, torch.from_numpy(weights)) + torch.from_numpy(biases)[:, None]
    ref, bound = reference_logprobs(translated, tiny_head)
    assert_topk_close(got["token_ids"], got["logprobs"], ref, bound, "affine lens")
    plain, _ = reference_logprobs(stream, tiny_head)
    assert not torch.equal(ref.topk(4).indices, plain.topk(4).indices), "the translation should change the readout"


def sae_reference(stream: np.ndarray, sae: SaeEncoder, k: int) -> tuple[np.ndarray, np.ndarray]:
    x = stream.astype(np.float64)
    if sae.apply_b_dec_to_input:
        x = x - sae.b_dec
    pre = x @ sae.W_enc + sae.b_enc
    if sae.activation == "jumprelu":
        acts = pre * (pre > sae.threshold)
    elif sae.activation == "topk":
        keep = np.argsort(-pre, axis=-1)[:, : sae.k]
        acts = np.zeros_like(pre)
        np.put_along_axis(acts, keep, np.maximum(np.take_along_axis(pre, keep, -1), 0), -1)
    else:
        acts = np.maximum(pre, 0)
    order = np.argsort(-acts, axis=-1, kind="stable")[:, :k]
    values = np.take_along_axis(acts, order, -1)
    return np.where(values > 0, order, -1), values


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_sae_latents_equal_host_encoder_on_the_capture(llm, activation: str) -> None:
    rng = np.random.default_rng(5)
    n = 96
    extra: dict[str, Any] = {"threshold": np.abs(rng.normal(size=n)).astype(np.float32)} if activation == "jumprelu" else {}
    if activation == "topk":
        extra["k"] = 8
    sae = SaeEncoder(
        W_enc=rng.normal(size=(HIDDEN, n)).astype(np.float32) / np.sqrt(HIDDEN),
        b_enc=rng.normal(size=n).astype(np.float32) * 0.1,
        b_dec=rng.normal(size=HIDDEN).astype(np.float32),
        apply_b_dec_to_input=True,
        activation=activation,
        **extra,
    )
    (out,) = capture_and_read(llm, [SaeReadout(name="sae", layer=2, top_k=6, sae=sae)], prompts=PROMPTS[2:3])
    got = out.activations["readouts"]["sae"]
    assert got["layer"] == 2
    ids, values = sae_reference(out.activations["residual_stream"][2].numpy(), sae, 6)
    stream = out.activations["residual_stream"][2].double()
    # a latent is w_j . (h - b_dec) + b_j: its error is within ||w_j|| * stream_bound() * ||h|| (Cauchy-Schwarz)
    bound = stream_bound() * np.linalg.norm(sae.W_enc, axis=0).max() * (stream.norm(dim=-1) + np.linalg.norm(sae.b_dec)).numpy()
    assert np.all(np.abs(got["values"].numpy() - values) <= bound[:, None] + 1e-6)
    clear = np.abs(values[:, :-1] - values[:, 1:]).min(axis=-1) > 2 * bound  # no near-ties: ids must match exactly
    assert clear.sum() > 0
    assert np.array_equal(got["latent_ids"].numpy()[clear], ids[clear])


def test_planted_sae_latent_fires_where_its_direction_is_steered_in(llm) -> None:
    """Latent 7's encoder column is a direction d; d is added (scale 40) at layer 1 at positions 2
    and 4 only; b_enc[7] = -20 keeps it off elsewhere (d . h is small on the unsteered stream)."""
    from lens_evals import SteeringVector

    rng = np.random.default_rng(11)
    direction = rng.normal(size=HIDDEN).astype(np.float32)
    direction /= np.linalg.norm(direction)
    W_enc = np.zeros((HIDDEN, 16), np.float32)
    W_enc[:, 7] = direction
    b_enc = np.zeros(16, np.float32)
    b_enc[7] = -20.0
    sae = SaeReadout(name="planted", layer=1, top_k=2, sae=SaeEncoder(W_enc=W_enc, b_enc=b_enc))
    steer = SteeringVector(activations=direction[None], layer_indices=[1], scale=40.0, position_indices=[2, 4])
    params = greedy(3, output_readouts=[sae], apply_steering_vectors=[steer])
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    got = out.activations["readouts"]["planted"]
    fired = (got["latent_ids"][:, 0] == 7).nonzero().flatten().tolist()
    assert fired == [2, 4]
    assert torch.all(got["latent_ids"][:, 1] == -1) and torch.all(got["values"][[2, 4], 0] > 15)


def test_weights_are_sent_once_and_found_by_digest(llm) -> None:
    rng = np.random.default_rng(2)
    sae = SaeEncoder(W_enc=rng.normal(size=(HIDDEN, 32)).astype(np.float32), b_enc=np.zeros(32, np.float32))
    first = llm.generate([PROMPTS[1]], greedy(2, output_readouts=[SaeReadout(name="s", layer=3, top_k=4, sae=sae).to_json()]))[0]
    by_digest = {"kind": "sae", "name": "s", "layer": 3, "top_k": 4, "sae": {"digest": sae.content_digest()}}
    second = llm.generate([PROMPTS[1]], greedy(2, output_readouts=[by_digest]))[0]
    for field in ("latent_ids", "values"):
        assert torch.equal(first.activations["readouts"]["s"][field], second.activations["readouts"]["s"][field])
    unknown = {**by_digest, "sae": {"digest": "0" * 64}}
    with pytest.raises(ValueError, match="unknown SAE encoder digest"):
        llm.generate([PROMPTS[1]], greedy(2, output_readouts=[unknown]), use_tqdm=False)


def test_readouts_over_http_equal_offline_and_bad_ones_get_400(tiny_path: Path, llm) -> None:
    """Through the server (LensClient, wire-encoded arrays) the same readouts as offline; a
    bad readout is a 400 naming its reason, for that request alone."""
    from lens_evals.client import LensClient, lens_xargs
    from lens_evals.inspect_kit.provider.xargs import to_vllm_xargs
    from tests.conftest import lens_server

    rng = np.random.default_rng(4)
    sae = SaeReadout(
        name="s", layer=1, top_k=3, sae=SaeEncoder(W_enc=rng.normal(size=(HIDDEN, 24)).astype(np.float32), b_enc=np.zeros(24, np.float32))
    )
    readouts = [LensReadout(name="logit", layers=[0, 3], top_k=4), sae]
    (offline,) = llm.generate([PROMPTS[0]], greedy(5, output_readouts=readouts), use_tqdm=False)
    bad = {
        "layer out of range": ({"kind": "lens", "name": "x", "layers": [9]}, "out of range"),
        "top_k too large": ({"kind": "lens", "name": "x", "layers": [0], "top_k": 65}, "less than or equal to 64"),
        "SAE width": ({"kind": "sae", "name": "x", "layer": 0, "sae": {"W_enc": [[1.0]] * 64, "b_enc": [0.0]}}, "W_enc has 64 rows"),
        "unknown digest": ({"kind": "sae", "name": "x", "layer": 0, "sae": {"digest": "f" * 64}}, "unknown SAE encoder digest"),
        "name clash": ({"kind": "lens", "name": "s", "layers": [0]}, "unique across probes and readouts"),
        "unknown kind": ({"kind": "tuned", "name": "x"}, "kind must be 'lens' or 'sae'"),
    }
    with lens_server(tiny_path) as server:
        client = LensClient(server.url, "test")
        got = client.generate(PROMPTS[0], max_tokens=5, ignore_eos=True, readouts=readouts).activations["readouts"]
        # the Inspect provider's encoding of the same objects is what the client sends
        assert to_vllm_xargs({"output_readouts": readouts})["output_readouts"] == lens_xargs(readouts=readouts)["output_readouts"]
        failures = []
        for name, (readout, message) in bad.items():
            try:
                client.generate(PROMPTS[0], max_tokens=2, vllm_xargs={"output_readouts": [sae.to_json(), json.dumps(readout)]})
                failures.append(f"{name}: accepted")
            except RuntimeError as exc:
                if "HTTP 400" not in str(exc) or message not in str(exc):
                    failures.append(f"{name}: {exc}")
        assert not failures, "\n".join(failures)
    want = offline.activations["readouts"]
    assert got["logit"]["layers"] == [0, 3] and got["s"]["layer"] == 1
    for name, fields in (("logit", ("token_ids", "logprobs")), ("s", ("latent_ids", "values"))):
        for field in fields:
            assert torch.equal(torch.as_tensor(got[name][field]), want[name][field]), f"{name}.{field} over HTTP vs offline"


def test_readouts_of_a_mixed_batch_equal_each_request_alone(llm) -> None:
    """Requests 0 and 2 share the logit lens (one group per layer, rows not contiguous: request 1
    between them reads only an SAE); each equals its run alone."""
    rng = np.random.default_rng(8)
    sae = SaeReadout(
        name="s", layer=0, top_k=2, sae=SaeEncoder(W_enc=rng.normal(size=(HIDDEN, 8)).astype(np.float32), b_enc=np.zeros(8, np.float32))
    )
    lens = LensReadout(name="l", layers=[1, 3], top_k=3)
    params = [greedy(4, output_readouts=[lens]), greedy(3, output_readouts=[sae]), greedy(5, output_readouts=[lens, sae])]
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        (alone,) = llm.generate([prompt], p, use_tqdm=False)
        assert together[i].outputs[0].token_ids == alone.outputs[0].token_ids
        for name, got in together[i].activations["readouts"].items():
            want = alone.activations["readouts"][name]
            for field, value in got.items():
                if isinstance(value, torch.Tensor) and value.dtype == torch.int32:
                    assert torch.equal(value, want[field]), f"request {i} {name}.{field}"
                elif isinstance(value, torch.Tensor):
                    assert torch.allclose(value, want[field], atol=1e-4), f"request {i} {name}.{field}"


def test_gemma2_logit_lens_uses_its_offset_norm_and_soft_cap(tmp_path_factory) -> None:
    """Gemma 2: RMSNorm scaled by (1 + w), tied unembedding, final logit soft-capping; the
    readout must follow the model's own head, not Llama's. Last in the module: a second engine
    in this process leaves the module's engine without its parallel state."""
    from tests.arch_zoo import build

    path = build("Gemma2ForCausalLM")
    head = hf_head(path)
    assert head[2], "the zoo's Gemma 2 should soft-cap its logits"
    with make_llm(path) as engine:
        (out,) = capture_and_read(engine, [{"kind": "lens", "name": "l", "layers": "all", "top_k": 5}], prompts=PROMPTS[:1])
    got = out.activations["readouts"]["l"]
    ref, bound = reference_logprobs(out.activations["residual_stream"], head)
    assert_topk_close(got["token_ids"], got["logprobs"], ref, bound, "gemma2")
    unnormed = torch.log_softmax(head[0](out.activations["residual_stream"]) @ head[1].T, dim=-1)  # soft-cap left out
    assert (unnormed.topk(5).values - got["logprobs"]).abs().max() > 1e-2, "soft-capping should matter on this model"
