"""Lens readouts on a tensor-parallel engine: the unembedding is split by vocabulary over the
ranks; the readout must see every shard (the model's logits gather) and come back once. Checked
against HF's head applied to the same request's capture, as on one worker (test_readouts.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lens_evals.request.readouts import LensReadout, SaeEncoder, SaeReadout
from tests.conftest import greedy, make_llm
from tests.engine.test_parallel import NEEDS_TWO_GPUS_ON_A_GPU, bind_two_workers, rank_replies  # noqa: F401 - fixtures
from tests.engine.test_readouts import PROMPTS, assert_topk_close, hf_head, reference_logprobs, sae_reference


@NEEDS_TWO_GPUS_ON_A_GPU
def test_tensor_parallel_2_lens_readout_sees_every_vocabulary_shard(tiny_path: Path, bind_two_workers, rank_replies) -> None:  # noqa: F811
    rng = np.random.default_rng(9)
    sae = SaeEncoder(W_enc=rng.normal(size=(128, 40)).astype(np.float32), b_enc=np.zeros(40, np.float32))
    readouts = [LensReadout(name="logit", layers="all", top_k=6), SaeReadout(name="s", layer=2, top_k=3, sae=sae)]
    with make_llm(tiny_path, max_model_len=512, tensor_parallel_size=2) as llm:
        outs = llm.generate(PROMPTS, greedy(4, output_residual_stream=True, output_readouts=readouts), use_tqdm=False)
    head = hf_head(tiny_path)
    vocab = head[1].shape[0]
    for n, out in enumerate(outs):
        got = out.activations["readouts"]["logit"]
        ref, bound = reference_logprobs(out.activations["residual_stream"], head)
        assert_topk_close(got["token_ids"], got["logprobs"], ref, bound, f"TP=2 prompt {n}")
        ids = got["token_ids"]
        assert (ids >= vocab // 2).any() and (ids < vocab // 2).any(), "top tokens should come from both vocabulary shards"
        want_ids, _ = sae_reference(out.activations["residual_stream"][2].numpy(), sae, 3)
        assert (out.activations["readouts"]["s"]["latent_ids"].numpy() == want_ids).mean() > 0.9
    (replies,) = rank_replies
    with_readouts = [sum("readouts" in result for result in reply.values()) for reply in replies]
    assert with_readouts == [len(PROMPTS), 0], "rank 0 alone sends the readouts"
