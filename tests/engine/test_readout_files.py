"""Readout weights reach the workers through a file written once per digest
(``transport/readout_files.py``), not inline with every request: the file holds exactly the
weights sent (every field, same digest), only a regular file of this user named for that digest
is read, it outlives its digest's eviction while a request in flight names it and no longer, and a
dead frontend's files are swept. End to end on the tiny engine: the frontend sends a file, not the
weights, and the readouts read through it equal the inline ones computed before this path existed
(``test_readouts.py`` holds them to HF's head and numpy)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lens_evals.engine import compat
from lens_evals.engine.transport import readout_files
from lens_evals.engine.transport.handoff import sweep_stale
from lens_evals.engine.transport.readout_cache import WeightsByDigest
from lens_evals.request.readouts import AffineLens, SaeEncoder


def affine(seed: int, d: int = 8) -> AffineLens:
    rng = np.random.default_rng(seed)
    return AffineLens(
        layers=[1, 3], weights=rng.normal(size=(2, d, d)).astype(np.float32), biases=rng.normal(size=(2, d)).astype(np.float32)
    )


def jumprelu_sae(seed: int, d: int = 8, n: int = 16) -> SaeEncoder:
    rng = np.random.default_rng(seed)
    return SaeEncoder(
        W_enc=rng.normal(size=(d, n)).astype(np.float32),
        b_enc=rng.normal(size=n).astype(np.float32),
        b_dec=rng.normal(size=d).astype(np.float32),
        threshold=np.abs(rng.normal(size=n)).astype(np.float32),
        activation="jumprelu",
        apply_b_dec_to_input=True,
    )


@pytest.mark.parametrize(
    "weights",
    [affine(0), jumprelu_sae(1), SaeEncoder(W_enc=np.eye(8, 4, dtype=np.float32), b_enc=np.ones(4, np.float32), activation="topk", k=2)],
)
def test_the_file_holds_exactly_the_weights(tmp_path: Path, weights: AffineLens | SaeEncoder) -> None:
    path = readout_files.write(str(tmp_path), weights)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no partial file left
    back = readout_files.read(path, weights.content_digest())
    assert type(back) is type(weights) and back.content_digest() == weights.content_digest()
    for name in weights.arrays:
        mine, theirs = getattr(weights, name), getattr(back, name)
        assert (mine is None and theirs is None) or np.array_equal(mine, theirs)
    assert back.model_dump(exclude={*weights.arrays, "digest"}) == weights.model_dump(exclude={*weights.arrays, "digest"})


def test_only_our_file_of_that_digest_is_read(tmp_path: Path) -> None:
    lens, other = affine(0), affine(1)
    path = readout_files.write(str(tmp_path), lens)
    digest = lens.content_digest()
    with pytest.raises(ValueError, match="not a lens_evals weights file"):
        readout_files.read(path, other.content_digest())  # the name is another digest's
    with pytest.raises(ValueError, match="not a lens_evals weights file"):
        readout_files.read(str(tmp_path / "elsewhere"), digest)
    swapped = readout_files.write(str(tmp_path), other)
    os.replace(swapped, path)  # another lens's file under this digest's name
    with pytest.raises(ValueError, match="holds other weights"):
        readout_files.read(path, digest)
    os.unlink(path)
    target = tmp_path / "target"
    target.write_bytes(b"x")
    os.symlink(target, path)  # a link is never followed
    with pytest.raises(ValueError, match="cannot be read here"):
        readout_files.read(path, digest)
    os.unlink(path)
    with open(path, "wb") as handle:
        handle.write(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="malformed"):
        readout_files.read(path, digest)
    os.unlink(path)
    with pytest.raises(ValueError, match="are gone"):
        readout_files.read(path, digest)


def test_a_file_outlives_its_eviction_while_a_request_names_it(tmp_path: Path) -> None:
    first, second, third = affine(0), affine(1), affine(2)
    cache = WeightsByDigest(max_bytes=first.nbytes())  # room for one lens: each new one evicts the last
    _, sent = cache.resolve(first, str(tmp_path))
    assert set(sent) == {"digest", "file"} and sent["digest"] == first.content_digest()  # no weights inline
    kept = sent["file"]
    cache.hold(first.content_digest())  # a request in flight names it
    _, again = cache.resolve(first, str(tmp_path))
    assert again["file"] == kept and len(os.listdir(tmp_path)) == 1  # written once
    cache.resolve(second, str(tmp_path))  # evicts the first: its request still runs
    assert os.path.exists(kept)
    with pytest.raises(ValueError, match="unknown affine lens digest"):
        cache.resolve(AffineLens(digest=first.content_digest()))
    cache.release(first.content_digest())
    assert not os.path.exists(kept)  # the last request naming it ended
    _, sent_second = cache.resolve(second, str(tmp_path))
    cache.resolve(third, str(tmp_path))  # evicts the second, which no request names
    assert not os.path.exists(sent_second["file"])
    _, inline = cache.resolve(third)  # no directory: inline, as to workers on other hosts
    assert np.array_equal(AffineLens.from_wire(inline).weights, third.weights)
    cache.remove_files()
    assert os.listdir(tmp_path) == []


def test_a_dead_frontends_weights_files_are_swept(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead = int(done.stdout)
    mine = readout_files.write(str(tmp_path), affine(0))
    digest = affine(1).content_digest()
    stale = tmp_path / os.path.basename(mine).replace(f"-{os.getpid()}-", f"-{dead}-").replace(affine(0).content_digest(), digest)
    partial = tmp_path / f"{stale.name}.0123abcd.partial"
    for path in (stale, partial):
        path.write_bytes(b"x")
    assert sorted(sweep_stale(str(tmp_path))) == sorted([stale.name, partial.name])
    assert os.listdir(tmp_path) == [os.path.basename(mine)]  # a live frontend's file stays


@pytest.mark.parametrize(
    ("parallel", "shared"),
    [
        ({"distributed_executor_backend": "mp"}, True),
        ({"distributed_executor_backend": "uni"}, True),
        ({"distributed_executor_backend": "ray"}, False),
        ({"distributed_executor_backend": "external_launcher"}, False),
        ({"distributed_executor_backend": "mp", "nnodes": 2}, False),
        ({"distributed_executor_backend": "mp", "data_parallel_size": 4, "data_parallel_size_local": 2}, False),
        ({"distributed_executor_backend": "mp", "data_parallel_size": 2, "data_parallel_size_local": 2}, True),
    ],
)
def test_files_only_where_every_worker_shares_the_host(parallel: dict[str, object], shared: bool) -> None:
    config = SimpleNamespace(parallel_config=SimpleNamespace(**parallel))
    assert compat.config.workers_share_host(config) is shared


def test_the_engine_sends_a_file_and_reads_the_same_latents(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    from lens_evals.engine.transport import readout_cache
    from lens_evals.request.readouts import SaeReadout
    from tests.conftest import TINY_PROMPTS, greedy

    rng = np.random.default_rng(5)
    sae = SaeEncoder(W_enc=rng.normal(size=(128, 32)).astype(np.float32), b_enc=np.zeros(32, np.float32))
    readout = SaeReadout(name="s", layer=2, top_k=4, sae=sae)
    by_file = llm.generate(TINY_PROMPTS[:2], greedy(3, output_readouts=[readout.to_json()]), use_tqdm=False)
    names = [os.path.basename(path) for path in readout_cache.held_files()]
    assert f"-{sae.content_digest()}" in " ".join(names)  # the frontend wrote the file: the weights went by it
    monkeypatch.setenv("LENS_EVALS_HANDOFF", "0")  # the inline path, as before files
    # the same weights would be found in the worker's cache: a new digest, the same math to float32
    fresh = SaeEncoder(W_enc=sae.W_enc.copy(), b_enc=np.full(32, 1e-30, np.float32))
    assert fresh.content_digest() != sae.content_digest()
    inline = llm.generate(
        TINY_PROMPTS[:2], greedy(3, output_readouts=[readout.model_copy(update={"sae": fresh}).to_json()]), use_tqdm=False
    )
    for a, b in zip(by_file, inline):
        got, want = a.activations["readouts"]["s"], b.activations["readouts"]["s"]
        assert np.array_equal(np.asarray(got["latent_ids"]), np.asarray(want["latent_ids"]))
        assert np.allclose(np.asarray(got["values"]), np.asarray(want["values"]), atol=1e-5)
