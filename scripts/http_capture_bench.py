"""Over-HTTP capture against the offline capture of the same prompts, in one run (issue #21: "over
HTTP within 1.3x of offline").

(a) offline: ``vllm.LLM`` (``lens_evals.engine.frontend.offline``) generates N token-id prompts (the prefill
bench's lengths and ids) with ``max_tokens=1`` capturing one layer, all in one ``generate`` call;
wall time from submit until every capture is on the host (torch, native dtype); each round also
times the same call without a capture (``plain_wall_seconds``); the engine is then shut down.
(b) a lens server on the same model and engine arguments gets the same prompts as
``/v1/completions`` with ``prompt`` = the token ids over ``--concurrency`` connections, once per
response encoding of ``lens_evals.wire.formats.RESPONSE_ENCODINGS`` per round and once without a capture
(``plain``: what serving the prompts over HTTP costs vLLM alone, against plain offline), in a
rotated order; wall time until every response is decoded into tensors (where it was read: on a
thread per connection through ``LensClient``'s urllib3 pool, or its former httpx client with
``--client httpx-threads``, or with ``--client asyncio`` in one event loop as Inspect's provider
reads), and the CPU time per response of this client, the API server and its engine core. Several
``--client`` and ``--concurrency`` values give a pass for each combination. Every HTTP
capture is checked against the offline one (dtype, shape = prompt length, bit-equal or else every
row nearer its own offline row than its neighbours' and the per-token relative error within a
bound: tests/tolerance.py's for the backend, 10 % in bf16 / fp16, or twice the floor the run
measures if larger: the offline capture again in calls of ``--concurrency`` prompts, in order and
shuffled, against the single call). Writes a JSON report.

    cd /tmp && PYTHONPATH=/work/main /work/main/.venv/bin/python /work/main/scripts/http_capture_bench.py \\
        --model tiny-llama --prompts 64 --rounds 1 --out /tmp/http_capture.json

Run it from a directory without a ``lens_evals`` package (the server's ``python -m`` puts the
working directory first on its path). Token-id prompts need no tokenizer: with
``--engine-arg skip_tokenizer_init=true`` neither engine loads one.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import torch
import urllib3
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the checkout's, not in the wheel

from benchmarks.prefill import prefill_lengths
from benchmarks.process_stats import cpu_seconds, engine_core_pid, peak_rss_gib, reset_peak_rss
from benchmarks.prompts import make_prompts
from benchmarks.wide_model import WIDE_LLAMA, build_wide_llama
from lens_evals.client import decode_activations, http_pool, lens_xargs
from lens_evals.engine.frontend.offline import add_engine_arg_option, close_offline_engine, open_offline_engine, parse_engine_args
from lens_evals.inspect_kit.provider.server import LensServer
from lens_evals.models.lookup import model_config
from lens_evals.models.registry import resolve_model
from lens_evals.wire import formats as wire
from lens_evals.wire import frame as wire_frame

# tests/tolerance.py's per-token bounds (max over tokens of ||got_t - ref_t|| / ||ref_t||) for two
# runs of one model with different batch shapes: measured floor x ~10 on CPU, TF32 estimate on GPU.
CPU_BOUND, GPU_BOUND = 1e-4, 2e-2
# bf16 / fp16: a request's rows round otherwise in another batch or another split of its prefill
# into chunks (measured on the 2-core CPU, 2026-12-05: 0.6 % against a floor of 0.12 % in calls of
# the concurrency; 4.1 % on the H200); a row of another token or prompt is off by far more, and the
# nearest-row check catches it whatever the bound
HALF_BOUND = 0.1
FLOOR_MARGIN = 2.0  # the bound is at least this times the offline batch-shape floor measured in the run
WARMUP_PROMPTS = 8
PLAIN = "plain"  # the prompts without a capture: vLLM's own cost of serving them over HTTP
MAX_MODEL_LEN = 1024  # prompts are 40-400 tokens


def offline_capture(
    model: str, prompts: list[list[int]], layer: int, engine: dict[str, Any], rounds: int, batch: int
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """(captures, report row): the median of ``rounds`` timed ``generate`` calls after a warm-up,
    and the batch-shape floor: the largest per-token relative error of two untimed passes in calls
    of ``batch`` prompts (in order, then in a shuffled order: other company for each prompt)
    against the last timed one (``bit_equal_prompts``: the fewest of the two)."""
    from vllm import SamplingParams

    reset_peak_rss()
    started = time.perf_counter()
    llm = open_offline_engine(model, **engine)
    start_seconds = time.perf_counter() - started
    plain = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=lens_xargs([layer]))
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    llm.generate(inputs[:WARMUP_PROMPTS], params, use_tqdm=False)
    walls: list[float] = []
    plain_walls: list[float] = []  # the same prompts without a capture, each round before it
    captures: list[torch.Tensor] = []
    try:
        for _ in range(rounds):
            gc.collect()
            began = time.perf_counter()
            llm.generate(inputs, plain, use_tqdm=True)
            plain_walls.append(time.perf_counter() - began)
            captures = []
            gc.collect()
            began = time.perf_counter()
            outputs = llm.generate(inputs, params, use_tqdm=True)
            captures = [output.activations["residual_stream"] for output in outputs]
            walls.append(time.perf_counter() - began)
            del outputs
        # the floor: the same prompts again in calls of the server's concurrency (other batches,
        # as the server's), against the last timed run; bf16 rounds otherwise there
        floors = []
        for order in (list(range(len(inputs))), random.Random(0).sample(range(len(inputs)), len(inputs))):
            regrouped: dict[int, torch.Tensor] = {}
            for start in range(0, len(order), batch):
                chunk = order[start : start + batch]
                outputs = llm.generate([inputs[i] for i in chunk], params, use_tqdm=False)
                regrouped.update((i, output.activations["residual_stream"]) for i, output in zip(chunk, outputs))
            floors.append(compare([regrouped[i] for i in range(len(inputs))], captures, prompts, bound=float("inf")))
            del regrouped
        floor = {
            "bit_equal_prompts": min(row["bit_equal_prompts"] for row in floors),
            "max_token_relative_error": max(row["max_token_relative_error"] for row in floors),
            "bound": None,  # measured, not checked (JSON has no Infinity)
        }
    finally:
        close_offline_engine(llm)
        del llm
        gc.collect()
    row = {
        "wall_seconds": round(sorted(walls)[len(walls) // 2], 3),
        "all_wall_seconds": [round(w, 3) for w in walls],
        "plain_wall_seconds": round(sorted(plain_walls)[len(plain_walls) // 2], 3),
        "engine_start_seconds": round(start_seconds, 1),
        "dtype": str(captures[0].dtype).removeprefix("torch."),
        "capture_bytes": sum(c.numel() * c.element_size() for c in captures),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "batch_floor": floor,
    }
    return captures, row


Reply = tuple[Any, int, float]  # (the capture, response bytes, decode seconds)


def _decoded(status: int, content: bytes, content_type: str | None) -> Reply:
    """A response's capture (None for a plain request), decoded where it was read (as a client
    with several connections would; not on one thread behind all readers)."""
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {content[:500]!r}")
    began = time.perf_counter()
    activations = decode_activations(wire_frame.response_body(content, content_type))
    assert isinstance(activations, dict), "one prompt per request gives one activations dict"
    return activations.get("residual_stream"), len(content), time.perf_counter() - began


def _on_threads(post: Callable[[dict[str, Any]], Reply], bodies: list[dict[str, Any]], concurrency: int, desc: str) -> list[Reply]:
    replies: list[Reply | None] = [None] * len(bodies)
    with ThreadPoolExecutor(concurrency) as pool:
        futures = {pool.submit(post, body): i for i, body in enumerate(bodies)}
        for future in tqdm(as_completed(futures), total=len(bodies), desc=desc):
            replies[futures[future]] = future.result()
    return [reply for reply in replies if reply is not None]


def _with_threads(url: str, bodies: list[dict[str, Any]], concurrency: int, desc: str) -> list[Reply]:
    """``concurrency`` threads sharing one connection pool of ``lens_evals.client`` (LensClient's)."""
    pool = http_pool(timeout=1800, connections=concurrency)

    def post(body: dict[str, Any]) -> Reply:
        response = pool.request("POST", url, json=body)
        return _decoded(response.status, response.data, response.headers.get("content-type"))

    try:
        return _on_threads(post, bodies, concurrency, desc)
    finally:
        pool.clear()


def _with_httpx_threads(url: str, bodies: list[dict[str, Any]], concurrency: int, desc: str) -> list[Reply]:
    """The same with one ``httpx.Client`` (LensClient's transport until 2026-12-05)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(timeout=1800, limits=limits) as client:

        def post(body: dict[str, Any]) -> Reply:
            response = client.post(url, json=body)
            return _decoded(response.status_code, response.content, response.headers.get("content-type"))

        return _on_threads(post, bodies, concurrency, desc)


def _with_asyncio(url: str, bodies: list[dict[str, Any]], concurrency: int, desc: str) -> list[Reply]:
    """One event loop, ``concurrency`` requests in flight on an ``httpx.AsyncClient`` (as Inspect's
    provider does through its async OpenAI client)."""
    import asyncio

    async def run() -> list[Reply]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
            progress = tqdm(total=len(bodies), desc=desc)

            async def one(body: dict[str, Any]) -> Reply:
                async with gate:
                    response = await client.post(url, json=body)
                    reply = _decoded(response.status_code, response.content, response.headers.get("content-type"))
                progress.update()
                return reply

            replies = await asyncio.gather(*(one(body) for body in bodies))
            progress.close()
            return list(replies)

    return asyncio.run(run())


CLIENTS = {"asyncio": _with_asyncio, "threads": _with_threads, "httpx-threads": _with_httpx_threads}


def http_capture(
    server: LensServer, prompts: list[list[int]], layer: int, encoding: str, concurrency: int, client: str
) -> tuple[list[Any], dict[str, Any]]:
    """(captures, report row) for one pass over the prompts in one response encoding."""
    assert server.pid is not None, "the server is running"
    name, server_pid = server.served_name, server.pid
    reset_peak_rss()
    reset_peak_rss(server_pid)
    bodies: list[dict[str, Any]] = [{"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0} for ids in prompts]
    if encoding != PLAIN:
        xargs = lens_xargs([layer], encoding=encoding)
        bodies = [{**body, "vllm_xargs": xargs} for body in bodies]
    gc.collect()
    core_pid = engine_core_pid(server_pid)
    cpu_before = (cpu_seconds(), cpu_seconds(server_pid), cpu_seconds(core_pid) if core_pid else float("nan"))
    began = time.perf_counter()
    replies = CLIENTS[client](f"{server.url}/v1/completions", bodies, concurrency, encoding)
    wall = time.perf_counter() - began
    cpu_after = (cpu_seconds(), cpu_seconds(server_pid), cpu_seconds(core_pid) if core_pid else float("nan"))
    client_cpu, server_cpu, core_cpu = (after - before for after, before in zip(cpu_after, cpu_before))
    captures = [capture for capture, _, _ in replies]
    sizes = sum(nbytes for _, nbytes, _ in replies)
    decode_seconds = sum(seconds for _, _, seconds in replies)
    row = {
        "encoding": encoding,
        "concurrency": concurrency,
        "wall_seconds": round(wall, 3),
        "response_bytes": sizes,
        "client": client,
        "client_decode_seconds": round(decode_seconds, 3),  # summed over the responses
        # CPU time per response: this client process, the API server process, its engine core
        "client_cpu_ms_per_response": round(1e3 * client_cpu / len(bodies), 3),
        "server_cpu_ms_per_response": round(1e3 * server_cpu / len(bodies), 3),
        "engine_core_cpu_ms_per_response": round(1e3 * core_cpu / len(bodies), 3),
        "dtype": None if captures[0] is None else str(captures[0].dtype).removeprefix("torch."),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "server_peak_rss_gib": round(peak_rss_gib(server_pid), 2),  # the API server process (not its engine core)
    }
    return captures, row


def compare(got: list[Any], ref: list[torch.Tensor], prompts: list[list[int]], bound: float) -> dict[str, Any]:
    """Dtype, shapes (one row per prompt token) and values of the HTTP captures against offline:
    bit-equal, or within ``bound`` (max per-token relative error) with every row nearer its own
    offline row than its neighbours' (a row shifted, or another prompt's, fails that whatever the
    rounding); ``"problem"`` says what fails (recorded, so a long GPU run still writes its report)."""
    bit_equal, worst, misplaced = 0, 0.0, 0
    for i, (g, r, ids) in enumerate(zip(got, ref, prompts)):
        g = torch.as_tensor(g)
        if g.dtype != r.dtype or tuple(g.shape) != tuple(r.shape) or g.shape[1] != len(ids):
            return {"problem": f"prompt {i}: HTTP {g.dtype} {tuple(g.shape)} vs offline {r.dtype} {tuple(r.shape)}, {len(ids)} tokens"}
        if torch.equal(g, r):
            bit_equal += 1
            continue
        g64, r64 = g.double(), r.double()  # (layers, tokens, hidden)
        own = (g64 - r64).norm(dim=-1)
        worst = max(worst, (own / r64.norm(dim=-1).clamp_min(1e-30)).max().item())
        misplaced += int(
            ((own[:, :-1] >= (g64[:, :-1] - r64[:, 1:]).norm(dim=-1)) | (own[:, 1:] >= (g64[:, 1:] - r64[:, :-1]).norm(dim=-1))).sum()
        )
    row: dict[str, Any] = {"bit_equal_prompts": bit_equal, "max_token_relative_error": worst, "bound": bound, "misplaced_rows": misplaced}
    if worst > bound:
        row["problem"] = f"HTTP captures differ from offline: max per-token relative error {worst:.3g} > {bound}"
    if misplaced:
        row["problem"] = f"{misplaced} HTTP rows are nearer a neighbouring token's offline row than their own"
    return row


def server_value(value: Any) -> Any:
    """An engine argument as the server's command line takes it (dicts as JSON)."""
    return json.dumps(value) if isinstance(value, dict) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help=f"an embedded model's name, a model directory, or {WIDE_LLAMA} (hidden 4,096 and little compute: an 8B's bytes per token on a CPU)",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--layer", type=int, help="the layer captured (default: the middle one)")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[64], help="requests in flight (several: a pass at each; the floor uses the least)"
    )
    parser.add_argument(
        "--client",
        nargs="+",
        choices=sorted(CLIENTS),
        default=["threads"],
        help="threads: a thread per connection on LensClient's pool (urllib3; default); httpx-threads: the same on one "
        "httpx.Client; asyncio: one event loop on httpx.AsyncClient, as Inspect's provider reads (several: a pass with each)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    encodings = [PLAIN, *wire.RESPONSE_ENCODINGS]
    parser.add_argument(
        "--encodings",
        nargs="+",
        choices=encodings,
        default=encodings,
        help="the passes per round (default: all; plain = the same requests without a capture)",
    )
    parser.add_argument("--out", type=Path, required=True)
    add_engine_arg_option(parser)
    args = parser.parse_args()
    if args.model == WIDE_LLAMA:
        args.model = str(build_wide_llama())
    config = model_config(args.model)
    if config is None:
        parser.error(f"argument --model: no config.json in {args.model} (the bench reads its layers and vocabulary)")
    layer = config["num_hidden_layers"] // 2 if args.layer is None else args.layer
    # no prefix caching: a plain pass would otherwise reuse the KV of the pass before it (lens
    # requests never do: each has its own cache salt), as the bench's systems
    engine = {
        "dtype": args.dtype,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "enable_prefix_caching": False,
        **parse_engine_args(args.engine_arg),
    }
    lengths = prefill_lengths(args.prompts)
    prompts = make_prompts(args.prompts, Path(resolve_model(args.model)), config["vocab_size"], lengths=lengths)

    reference, offline = offline_capture(args.model, prompts, layer, engine, args.rounds, min(args.concurrency))
    base_bound = GPU_BOUND if torch.cuda.is_available() else CPU_BOUND  # after the engine: CUDA untouched before it
    if offline["dtype"] in ("bfloat16", "float16"):
        base_bound = HALF_BOUND
    floor = offline["batch_floor"]["max_token_relative_error"]
    bound = max(base_bound, FLOOR_MARGIN * floor)
    print(
        f"offline in calls of {min(args.concurrency)}, in order and shuffled: bit-equal {offline['batch_floor']['bit_equal_prompts']}/{args.prompts}, "
        f"max per-token relative error {floor:.3g}; bound {bound:.3g}"
    )
    print(f"offline: {offline['wall_seconds']} s (median of {offline['all_wall_seconds']}), {offline['dtype']}")
    name = "bench"
    server_args = {key: server_value(value) for key, value in engine.items()}
    server = LensServer(resolve_model(args.model), served_name=name, server_args=server_args).start(timeout=1800)
    rows = []
    try:
        for concurrency in args.concurrency:  # every connection busy at least once
            for client in args.client:
                http_capture(server, prompts[: 2 * concurrency], layer, wire.DEFAULT_RESPONSE_ENCODING, concurrency, client)
        passes = [(e, n, c) for e in args.encodings for n in args.concurrency for c in args.client]
        for round_index in range(args.rounds):
            shift = round_index % len(passes)
            for encoding, concurrency, client in passes[shift:] + passes[:shift]:
                try:
                    captures, row = http_capture(server, prompts, layer, encoding, concurrency, client)
                except (httpx.HTTPError, urllib3.exceptions.HTTPError) as exc:  # a client's failure: recorded, the rest run
                    rows.append(
                        {"encoding": encoding, "concurrency": concurrency, "client": client, "round": round_index, "problem": repr(exc)}
                    )
                    continue
                row["round"] = round_index
                if encoding == PLAIN:  # against plain offline
                    row["ratio_http_offline"] = round(row["wall_seconds"] / offline["plain_wall_seconds"], 3)
                else:
                    row.update(compare(captures, reference, prompts, bound))
                    row["ratio_http_offline"] = round(row["wall_seconds"] / offline["wall_seconds"], 3)
                rows.append(row)
                del captures
    finally:
        server.stop()
    report = {
        "date": str(date.today()),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "model": args.model,
        "engine_args": engine,
        "prompts": args.prompts,
        "prompt_tokens": sum(lengths),
        "layer": layer,
        "concurrency": args.concurrency,
        "offline": offline,
        "http": rows,
        "check": "HTTP captures equal offline: same dtype, one row per prompt token, bit-equal or else each row "
        "nearer its own offline row than its neighbours' and within `bound` (max per-token relative error): "
        f"tests/tolerance.py's bound for the backend ({HALF_BOUND:g} in bf16 / fp16) or, if larger, "
        f"{FLOOR_MARGIN:g}x the offline batch-shape floor (`offline.batch_floor`)",
        "bound": bound,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"offline plain: {offline['plain_wall_seconds']:.2f} s (the plain row's ratio is against it)")
    print(f"offline: {offline['wall_seconds']:.2f} s, peak RSS {offline['peak_rss_gib']} GiB ({sum(lengths)} tokens, layer {layer})")
    for encoding, concurrency, client in passes:
        runs = sorted(
            (r for r in rows if (r["encoding"], r["concurrency"], r["client"]) == (encoding, concurrency, client) and "wall_seconds" in r),
            key=lambda r: r["wall_seconds"],
        )
        if not runs:
            continue
        mid = runs[len(runs) // 2]
        print(
            f"{encoding:>17} x{concurrency} {client}: wall {mid['wall_seconds']:7.2f} s (median of {[r['wall_seconds'] for r in runs]}) "
            f"= {mid['ratio_http_offline']:.2f}x offline, {mid['response_bytes'] / 2**20:8.1f} MiB, decode "
            f"{mid['client_decode_seconds']:.2f} s, CPU ms per response client {mid['client_cpu_ms_per_response']} "
            f"server {mid['server_cpu_ms_per_response']} engine core {mid['engine_core_cpu_ms_per_response']}, {mid['dtype']} on the wire, peak RSS {mid['peak_rss_gib']} GiB (server {mid['server_peak_rss_gib']}), "
            f"bit-equal {mid.get('bit_equal_prompts')}/{args.prompts}, max err {mid.get('max_token_relative_error')}"
        )
    print(f"wrote {args.out}")
    problems = [
        f"{row['encoding']} x{row['concurrency']} {row['client']} round {row['round']}: {row['problem']}"
        for row in rows
        if "problem" in row
    ]
    if problems:
        raise SystemExit("\n".join(problems))


if __name__ == "__main__":
    main()
