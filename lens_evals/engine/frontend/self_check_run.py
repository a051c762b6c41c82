"""Running the stream-contract self-check (:mod:`lens_evals.engine.frontend.self_check`) on an engine:
offline at the end of ``LLM.__init__`` (or, for the engine during whose construction vLLM loaded
the plugin, as its first call starts), on ``AsyncLLM`` (and so the server) at the first lens
request, awaited once by every caller. The result is kept in the engine's frontend state
(:func:`result_of`), where admission finds it."""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

from lens_evals import settings
from lens_evals.engine import compat
from lens_evals.engine.frontend.self_check import PROMPT, LayerCheck, Plan, Request, SelfCheck, logger
from lens_evals.engine.frontend.state import frontend_state
from lens_evals.engine.transport.graph_layers import configured_layers
from lens_evals.request.spec import LENS_KEYS

_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("lens_evals_self_check_running", default=False)


def result_of(processor: Any) -> SelfCheck | None:
    """The check's result on the engine of this input processor (None: not run yet or running)."""
    return frontend_state(processor).self_check


def refusal_of(processor: Any) -> str | None:
    """Why admission refuses lens requests after the check (None: passed, skipped, not run yet or running)."""
    result = result_of(processor)
    return None if result is None else result.refusal()


def _run_to_end(coroutine: Coroutine[Any, Any, SelfCheck]) -> SelfCheck:
    """A coroutine that never suspends (the offline check: its ``run`` blocks) run to its result,
    without an event loop (the caller may be inside one: a notebook)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        result: SelfCheck = done.value
        return result
    coroutine.close()
    raise RuntimeError("lens_evals: the offline self-check suspended")


def skip_reason(vllm_config: Any) -> str | None:
    """Why the check does not run on this engine (None: it runs)."""
    if not settings.SELF_CHECK.get():
        return f"{settings.SELF_CHECK.name}=0"
    return compat.frontend.engine_refusal(vllm_config) or compat.architectures.frontend_refusal(vllm_config.model_config)


def _start(vllm_config: Any) -> SelfCheck:
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    return SelfCheck(compat.architectures.architecture_of(vllm_config.model_config), dtype)


Rounds = Generator[list[Request], list[Any], list[LayerCheck]]


def _rounds(vllm_config: Any, prompt_ids: list[int], dtype: str) -> Rounds:
    """The check as a generator: yields each round's requests, is sent their outputs, returns
    the numbers (the offline and the async drivers run the same code)."""
    shape = compat.config.model_shape(vllm_config)
    plan = Plan(shape.num_layers, configured_layers(vllm_config, shape.num_layers))
    first = (yield plan.first_round())[0]
    second = yield plan.second_round(first.activations["residual_stream"], len(prompt_ids), shape.hidden_size, dtype=dtype)
    return plan.measure(first, second, prompt_ids, dtype)


def _finish(result: SelfCheck, started: float) -> SelfCheck:
    result.seconds = round(time.monotonic() - started, 3)
    log = logger.error if not (result.passed or result.skipped) else logger.warning if result.inconclusive else logger.info
    log("lens_evals: %s", result.table())
    return result


async def run_with(
    vllm_config: Any, tokenize: Callable[[str], list[int]], run: Callable[[list[Request]], Awaitable[list[Any]]]
) -> SelfCheck:
    """The check, its requests run by ``run`` (a list of :class:`Request` -> their outputs)."""
    started, result = time.monotonic(), _start(vllm_config)
    if (why := skip_reason(vllm_config)) is not None:
        result.skipped = why
        return _finish(result, started)
    try:
        rounds = _rounds(vllm_config, tokenize(PROMPT), result.dtype)
        requests = next(rounds)
        while True:
            requests = rounds.send(await run(requests))
    except StopIteration as stop:
        result.layers = stop.value
    except Exception as exc:  # noqa: BLE001 - any failure of the check's own requests fails the check, with why
        result.error = f"{type(exc).__name__}: {exc}"
    return _finish(result, started)


def sampling_params(request: Request) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0 if request.logprobs else None, extra_args=request.extra)


def token_prompt(vllm_config: Any) -> list[int]:
    """The check's prompt as token ids, for an engine without a tokenizer (``skip_tokenizer_init``,
    as ``lens-evals capture`` starts one): 16 fixed ids spread over the vocabulary, clear of the
    low ids where special tokens usually live."""
    vocab = int(vllm_config.model_config.get_vocab_size())
    low = min(1000, vocab // 4)
    return [low + (7919 * k) % max(vocab - low, 1) for k in range(16)]


def _prompt_and_ids(get_tokenizer: Callable[[], Any], vllm_config: Any) -> tuple[Any, Callable[[str], list[int]]]:
    """(the prompt to send, how the check learns its token ids): the text through the engine's
    tokenizer, or token ids where the engine has none."""
    try:
        tokenizer = get_tokenizer()
    except ValueError:  # vLLM: "Tokenizer not available when `skip_tokenizer_init=True`"
        ids = token_prompt(vllm_config)
        return {"prompt_token_ids": ids}, lambda text: ids
    return PROMPT, lambda text: list(tokenizer(text).input_ids)


# ALONE_NOTE: the check's requests run one at a time, each alone in its steps, so that the plain
# request and the identity requests meet the same batch composition. Where vLLM's numerics depend
# on the batch (fp8 with dynamic per-tensor activation scales: the scale is the batch's largest
# value), a plain request and an identity request batched differently differ for that reason
# alone: SmolLM2 loaded with quantization="fp8" on an H100 (2026-12-07), batched, moved 0.372 at
# layers 15 and 29 alike (the bf16 floor is 0.1) with handoff 0 and the steer check passing.


def check_offline(llm: Any) -> SelfCheck:
    """Run the check on an offline ``LLM`` (called at the end of its ``__init__``)."""
    prompt, tokenize = _prompt_and_ids(llm.get_tokenizer, llm.llm_engine.vllm_config)

    async def run(requests: list[Request]) -> list[Any]:  # synchronous inside: the offline engine's own loop
        # one request at a time (ALONE_NOTE)
        return [llm.generate([prompt], [sampling_params(r)], use_tqdm=False)[0] for r in requests]

    processor = compat.frontend.input_processor(llm.llm_engine)
    token = _RUNNING.set(True)
    try:
        result = _run_to_end(run_with(llm.llm_engine.vllm_config, tokenize, run))
    finally:
        _RUNNING.reset(token)
    frontend_state(processor).self_check = result
    return result


async def ensure_checked_async(engine: Any) -> SelfCheck | None:
    """On an ``AsyncLLM``: run the check once (the first caller starts it, every caller awaits
    the same task); None inside the check's own requests."""
    if _RUNNING.get():
        return None
    processor = compat.frontend.input_processor(engine)
    if (done := result_of(processor)) is not None:
        return done
    state = frontend_state(processor)
    task = state.self_check_task
    if task is None:
        # in an empty context: the request that starts it is inside an HTTP response, whose
        # results sink would otherwise collect the check's own outputs as that response's
        task = asyncio.get_running_loop().create_task(_check_async(engine, processor), context=contextvars.Context())
        state.self_check_task = task
    return await asyncio.shield(task)


def _no_tokenizer() -> Any:
    raise ValueError("the engine has no tokenizer")


async def _check_async(engine: Any, processor: Any) -> SelfCheck:
    _RUNNING.set(True)  # this task's own context: the check's requests do not wait for it
    try:
        tokenizer = await compat.frontend.async_tokenizer(engine)
    except ValueError:  # no tokenizer (skip_tokenizer_init): token ids
        tokenizer = None
    prompt, tokenize = _prompt_and_ids(lambda: tokenizer if tokenizer is not None else _no_tokenizer(), engine.vllm_config)

    async def one(request: Request) -> Any:
        final = None
        async for output in engine.generate(prompt, sampling_params(request), f"lens-self-check-{uuid.uuid4().hex}"):
            final = output
        return final

    async def run(requests: list[Request]) -> list[Any]:
        return [await one(r) for r in requests]  # one request at a time (ALONE_NOTE)

    result = await run_with(engine.vllm_config, tokenize, run)
    frontend_state(processor).self_check = result
    return result


def ensure_offline(llm: Any) -> None:
    """The check on an offline ``LLM``, once: at the end of its ``__init__`` (where the plugin was
    loaded before it; vLLM loads it inside the first engine's construction) or else as its first
    call starts."""
    if not _RUNNING.get() and result_of(compat.frontend.input_processor(llm.llm_engine)) is None:
        check_offline(llm)


def before_offline_call(then: Callable[[Any], None]) -> Callable[[Any], None]:
    """``ensure_offline`` and then ``then(llm)``, as an offline call starts."""

    def before(engine: Any) -> None:
        ensure_offline(engine)
        then(engine)

    return before


async def before_async_request(engine: Any, params: Any) -> None:
    """Before ``AsyncLLM.generate`` adds a request: a lens request waits for the check (run once)."""
    extra = getattr(params, "extra_args", None) or {}
    if any(key in extra for key in LENS_KEYS):
        await ensure_checked_async(engine)
