"""``lens-evals chat`` in a real headless chromium against a real lens server (tiny-llama; one
server for the module): type, send, stream, probe colours equal to an independent host
computation from a capture, hover (the last layer's lens names the chosen token, as greedy
decoding says it must), steer towards a planted token, bad input shown on the page, the oracle box
saying the server has no adapter, export to one self-contained file that opens offline."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch
from safetensors.numpy import load_file

from lens_evals.chat.app import build_app
from lens_evals.chat.setup import ChatOptions, open_backend
from lens_evals.inspect_kit.provider.lora_args import lora_server_args
from lens_evals.inspect_kit.provider.server import free_port
from lens_evals.models.registry import model_path
from lens_evals.oracle.inference import OracleSettings, injection_vector, oracle_prompt_ids
from lens_evals.probing.probe import load_probe
from tests.chat.browser import Browser, dump_dom
from tests.conftest import lens_server
from tests.device import on_gpu
from tests.lora_helpers import lora_dtype, random_adapter
from tests.report.test_report import random_probe
from tests.tolerance import assert_scores_close

MODEL = os.environ.get("LENS_EVALS_CHAT_TEST_MODEL", "tiny-llama")  # smollm2-135m-instruct: docs/chat.png
PROMPT = "the cat reads a book." if MODEL == "tiny-llama" else "Name three animals that live in the sea."
# the tiny tokenizer has " cat" as one token, not " ?" (tests/inspect_kit/test_oracle_solver.py)
ORACLE = OracleSettings(target_layer=2, injection_layer=1, placeholder=" cat") if MODEL == "tiny-llama" else OracleSettings(target_layer=15)

# a lens server's start and a dozen turns in a browser: minutes on the shared 2-core CPU machine
pytestmark = pytest.mark.slow


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None and on_gpu():
        pytest.skip("no chromium on the lent GPU machine (no network to install it); it runs on every CPU CI machine")
    assert path, "chromium is missing: scripts/setup.sh installs Debian's chromium"
    return path


def random_sae(directory: Path, hidden: int, layer: int) -> Path:
    """An SAE-Lens folder: a TopK SAE (k=4 of 64 latents) reading ``layer``, b_dec subtracted first."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    folder = directory / "sae"
    folder.mkdir()
    tensors = {
        "W_enc": rng.normal(size=(hidden, 64)).astype(np.float32),
        "b_enc": rng.normal(size=64).astype(np.float32),
        "W_dec": rng.normal(size=(64, hidden)).astype(np.float32),
        "b_dec": rng.normal(size=hidden).astype(np.float32),
    }
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    cfg = {
        "d_in": hidden,
        "d_sae": 64,
        "architecture": "topk",
        "k": 4,
        "hook_name": f"blocks.{layer}.hook_resid_post",
        "apply_b_dec_to_input": True,
    }
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def sae_reference(folder: Path, stream: np.ndarray) -> list[dict[int, float]]:
    """The SAE's positive latents per row, in torch (not the page's numpy code)."""
    tensors = {k: torch.from_numpy(v).double() for k, v in load_file(str(folder / "sae_weights.safetensors")).items()}
    pre = (torch.from_numpy(stream).double() - tensors["b_dec"]) @ tensors["W_enc"] + tensors["b_enc"]
    values, ids = pre.topk(4, dim=-1)
    return [{int(i): float(v) for i, v in zip(row_ids, row_values) if v > 0} for row_ids, row_values in zip(ids, values)]


def planted_vector(model_dir: Path, directory: Path) -> tuple[Path, int]:
    """A steering file: the unembedding row of one token, to add after the last layer with a large
    scale, so greedy decoding must pick that token (the direction the vector says)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    unembed = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    token = int(unembed.shape[0] // 2 + 7)
    path = directory / "planted.npy"
    np.save(path, (unembed[token] / np.linalg.norm(unembed[token])).astype(np.float32))
    return path, token


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Iterator[dict[str, Any]]:
    browser_path = chromium()
    directory = tmp_path_factory.mktemp("chat")
    model_dir = model_path(MODEL)
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    probe = random_probe(directory) if hidden == 128 else random_probe_of(directory, hidden, layers // 2)
    vector, token = planted_vector(model_dir, directory)
    sae = random_sae(directory, hidden, layers - 2)
    server_args = None
    if MODEL == "tiny-llama":  # a random adapter served as the oracle: the box's whole request path runs
        adapter = random_adapter(model_dir, directory / "oracle", 3, ["q_proj", "v_proj", "down_proj"])
        server_args = lora_server_args({"lora_modules": f"oracle={adapter}", "dtype": lora_dtype()})
    with lens_server(model_dir, server_args=server_args) as server:
        backend = open_backend(ChatOptions(server=server.url, probes=[str(probe)], vectors=[str(vector)], sae=str(sae)))
        backend.oracle = ORACLE
        import uvicorn

        port = free_port()
        web = uvicorn.Server(uvicorn.Config(build_app(backend), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=web.run, daemon=True)
        thread.start()
        while not web.started:
            time.sleep(0.05)
        browser = Browser(browser_path)
        try:
            browser.goto(f"http://127.0.0.1:{port}/")
            yield {"browser": browser, "server": server, "url": f"http://127.0.0.1:{port}", "probe": probe, "token": token,
                   "layers": layers, "chromium": browser_path, "backend": backend, "sae": sae}  # fmt: skip
        finally:
            browser.close()
            web.should_exit = True
            thread.join(timeout=30)


def random_probe_of(directory: Path, hidden: int, layer: int) -> Path:
    """random_probe's card for another model (the screenshot's SmolLM2)."""
    from lens_evals.probing.probe import Probe

    made = load_probe(random_probe(directory / "base"))
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(256, hidden))
    pipeline = made.pipeline.fit(rows, (rows[:, 0] > 0).astype(int))
    card = made.card.model_copy(update={"name": f"random-{hidden}", "layer": layer, "hidden_size": hidden, "model": MODEL})
    return Probe(pipeline=pipeline, card=card).save(directory)


def new_chat(browser: Browser) -> None:
    browser.js(
        "document.getElementById('clear').click(); document.getElementById('steer-source').value = ''; document.getElementById('max-tokens').value = 16; 0"
    )


def send(browser: Browser, text: str) -> dict[str, Any]:
    """Type ``text``, press Enter; the reply once its final event arrived, with the number of
    token spans the page had shown before it (streaming)."""
    browser.js(
        "window.pendingSeen = 0; new MutationObserver((changes) => { for (const c of changes) for (const n of c.addedNodes)"
        " if (n.classList && n.classList.contains('pending')) window.pendingSeen += 1; })"
        ".observe(document.getElementById('log'), {childList: true, subtree: true}); 0"
    )
    count = browser.js("window.chatState.messages.length")
    browser.type("#input", text)
    browser.press_enter()
    browser.wait_for(
        f"!window.chatState.busy && (window.chatState.messages.length === {count} + 2 || !!document.getElementById('error').textContent)"
    )
    error = browser.js("document.getElementById('error').textContent")
    assert not error, error
    reply: dict[str, Any] = browser.js("window.chatState.messages[window.chatState.messages.length - 1]")
    reply["pending_seen"] = browser.js("window.pendingSeen")
    return reply


def token_ids(reply: dict[str, Any]) -> list[int]:
    return [i for token in reply["tokens"] for i in token["ids"]]


def test_send_streams_colours_and_hovers(page) -> None:
    browser, server = page["browser"], page["server"]
    new_chat(browser)
    reply = send(browser, PROMPT)
    tokens = reply["tokens"]
    assert 0 < len(token_ids(reply)) <= 16, reply  # new_chat sets 16 max tokens
    assert reply["pending_seen"] >= 2, "the reply did not stream in: no grey tokens before the final event"
    shown = browser.js("Array.from(document.querySelectorAll('.msg.assistant .tok')).map(s => [s.textContent, s.style.background])")
    assert "".join(text for text, _ in shown) == reply["content"] and all(background.startswith("rgba(") for _, background in shown)

    # the probe's colours: its score at the position each token was chosen from, against the
    # probe's own scikit-learn pipeline on a capture of the same tokens (another request)
    probe = load_probe(page["probe"])
    prompt_ids = requests.post(
        f"{server.url}/tokenize", json={"model": "test", "messages": [{"role": "user", "content": PROMPT}]}, timeout=60
    )
    ids = prompt_ids.json()["tokens"] + token_ids(reply)
    body = {
        "model": "test",
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "vllm_xargs": {"output_residual_stream": [probe.layer, page["layers"] - 2]},
    }
    from lens_evals.client import activations_from_response

    captured = activations_from_response(requests.post(f"{server.url}/v1/completions", json=body, timeout=120).json())
    stream = np.asarray(captured["residual_stream"][0], dtype=np.float32)
    at = [token["position"] - 1 for token in tokens]
    assert tokens[0]["position"] == len(prompt_ids.json()["tokens"])
    weights, bias = probe.folded()
    got = torch.tensor([token["scores"][probe.card.name] for token in tokens])
    assert_scores_close(
        got,
        torch.from_numpy(probe.token_scores(stream[at])),
        torch.from_numpy(weights),
        torch.from_numpy(stream[at]),
        "page colours",
        bias=bias,
    )

    # the SAE's latents: its top latents on the capture of its layer, computed here in torch
    for token, reference in zip(tokens, sae_reference(page["sae"], np.asarray(captured["residual_stream"][1], dtype=np.float32)[at])):
        assert [i for i, _ in token["sae"]] == list(reference)
        np.testing.assert_allclose([v for _, v in token["sae"]], list(reference.values()), rtol=1e-3, atol=1e-3)

    # hover: the lens at every layer; at the last layer greedy decoding's choice is its top-1
    last = page["layers"] - 1
    for index in range(min(len(tokens), 4)):
        browser.hover(f'.tok[data-m="1"][data-t="{index}"]')
        rows = browser.wait_for("Array.from(document.querySelectorAll('#detail-body table.lens tr')).map(r => r.textContent)")
        assert len(rows) == page["layers"] and rows[0].startswith(f"L{last}"), rows
        chosen = requests.post(f"{server.url}/detokenize", json={"model": "test", "tokens": [tokens[index]["ids"][0]]}, timeout=60).json()[
            "prompt"
        ]
        top1 = tokens[index]["lens"][-1]["top"][0][0]
        assert tokens[index]["lens"][-1]["layer"] == last and top1 == chosen, (index, top1, chosen)
        assert rows[0].startswith(f"L{last}{json.dumps(chosen)}")
        assert browser.js("document.querySelector('#detail-body .sae').textContent").startswith("SAE sae (layer")
    browser.screenshot(Path(os.environ.get("LENS_EVALS_CHAT_SCREENSHOT", page["browser"].profile / "chat.png")))


def test_steering_plants_the_vectors_token(page) -> None:
    browser, token = page["browser"], page["token"]
    new_chat(browser)
    plain = send(browser, PROMPT)
    new_chat(browser)
    browser.js(
        "document.getElementById('steer-source').value = 'vector'; document.getElementById('steer-vector').value = 'planted';"
        f"document.getElementById('steer-layer').value = {page['layers'] - 1}; document.getElementById('steer-scale').value = 200; 0"
    )
    steered = send(browser, PROMPT)
    assert token not in token_ids(plain), "the planted token was already in the plain reply: pick another"
    assert token_ids(steered) and all(i == token for i in token_ids(steered)), (token, token_ids(steered))
    assert "steered: planted at layer" in browser.js("document.querySelector('.msg.assistant .steer').textContent")

    # a contrastive pair: the mean difference of the two prompts' streams at layer 1, scaled up
    new_chat(browser)
    browser.js(
        "document.getElementById('steer-source').value = 'pair'; document.getElementById('steer-positive').value = 'the cat the cat';"
        "document.getElementById('steer-negative').value = '1 2 3 4'; document.getElementById('steer-layer').value = 1;"
        "document.getElementById('steer-scale').value = 8; 0"
    )
    paired = send(browser, PROMPT)
    assert token_ids(paired) != token_ids(plain)
    assert 'steered: "the cat the cat" - "1 2 3 4" at layer 1 x 8' in browser.js(
        "document.querySelector('.msg.assistant .steer').textContent"
    )
    new_chat(browser)


def test_bad_input_is_shown_on_the_page(page) -> None:
    browser = page["browser"]
    new_chat(browser)
    browser.js("document.getElementById('steer-source').value = 'vector'; document.getElementById('steer-layer').value = 99; 0")
    browser.type("#input", PROMPT)
    browser.press_enter()
    error = browser.wait_for("document.getElementById('error').textContent")
    assert "99" in error and "layer" in error, error
    assert browser.js("document.getElementById('input').value") == PROMPT and browser.js("window.chatState.messages.length") == 0
    new_chat(browser)
    bad = requests.post(f"{page['url']}/api/chat", json={"messages": [], "max_tokens": 0}, timeout=30)
    assert bad.status_code == 400 and "messages" in bad.json()["error"] and "max_tokens" in bad.json()["error"]


def ask_in_the_box(browser: Browser, question: str) -> str:
    browser.js(
        f"document.getElementById('oracle-question').value = {json.dumps(question)}; document.getElementById('oracle-ask').click(); 0"
    )
    answer: str = browser.wait_for("(t => t !== 'asking...' && t)(document.getElementById('oracle-answer').textContent)")
    return answer


def test_oracle_box(page) -> None:
    """Without the adapter the box says so; with it, the answer equals one built here from the
    HF tokenizer's oracle prompt, a capture and the injection sent to the adapter directly."""
    browser, backend, server = page["browser"], page["backend"], page["server"]
    new_chat(browser)
    send(browser, PROMPT)
    backend.oracle_lora = "absent"
    try:
        answer = ask_in_the_box(browser, "What is the topic?")
    finally:
        backend.oracle_lora = "oracle"
    assert "serves no activation-oracle adapter named 'absent'" in answer and "--lora-modules" in answer, answer
    if MODEL != "tiny-llama":
        return
    messages = browser.js("window.chatState.messages.map(m => ({role: m.role, content: m.content}))")
    question = "which word is the text about?"
    answer = ask_in_the_box(browser, question)
    from transformers import AutoTokenizer

    body = {
        "model": "test",
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "vllm_xargs": {"output_residual_stream": [ORACLE.target_layer]},
    }
    from lens_evals.client import activations_from_response, lens_xargs

    acts = np.asarray(
        activations_from_response(requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json())["residual_stream"][0]
    )
    ids, positions = oracle_prompt_ids(AutoTokenizer.from_pretrained(str(model_path(MODEL))), ORACLE, acts.shape[0], question)
    vector = injection_vector(acts.astype(np.float32), positions, ORACLE)
    direct = {"model": "oracle", "prompt": ids, "max_tokens": 24, "temperature": 0, "vllm_xargs": lens_xargs(steering=[vector])}
    want = requests.post(f"{server.url}/v1/completions", json=direct, timeout=120).json()["choices"][0]["text"]
    assert answer == f"oracle (layer 2, {len(positions)} positions): {want}", (answer, want)


def test_export_is_one_file_that_opens_offline(page, tmp_path) -> None:
    browser = page["browser"]
    new_chat(browser)
    first = send(browser, PROMPT)
    second = send(browser, "and then?")
    exported = tmp_path / "conversation.html"
    exported.write_text(browser.js("exportHtml()"), encoding="utf-8")
    source = exported.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=|url\(|@import""", source), "the export refers to another file"
    dom = dump_dom(page["chromium"], exported)
    texts = re.findall(r'<div class="text">(.*?)</div></div>', dom, flags=re.S)
    visible = [re.sub(r'<span class="tip">.*?</span>', "", t, flags=re.S) for t in texts]
    plain = [
        re.sub(r"<[^>]+>", "", t).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"') for t in visible
    ]
    assert plain == [PROMPT, first["content"], "and then?", second["content"]]
    assert dom.count('class="tok"') == len(first["tokens"]) + len(second["tokens"]) and f"L{page['layers'] - 1}:" in dom
    data = json.loads(re.search(r'<script type="application/json" id="conversation">(.*?)</script>', source, flags=re.S).group(1))
    assert [m["content"] for m in data["messages"]] == [PROMPT, first["content"], "and then?", second["content"]]
