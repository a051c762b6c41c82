"""The TopK SAE: trained on data made of sparse combinations of planted directions, its decoder
recovers them; trained from a ``lens-evals capture`` directory, the folder it writes loads and
its held-out report says what it reconstructs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lens_evals.capture.manifest import CaptureManifest, RowRecord, ShardRecord, manifest_path, shard_name, write_atomic
from lens_evals.capture.shards import ShardBuffer
from lens_evals.capture.writer import ShardWriter
from lens_evals.readouts.runs import sae_from_capture
from lens_evals.readouts.sae_files import load_sae
from lens_evals.readouts.sae_train import SaeSettings, evaluate_sae, train_sae

D, FEATURES, ACTIVE = 16, 24, 3


def planted(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [n, D], directions [FEATURES, D])``: each row the sum of ACTIVE unit directions with
    magnitudes in [1, 3], plus an offset."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(FEATURES, D, generator=g)
    directions /= directions.norm(dim=1, keepdim=True)
    codes = torch.zeros(n, FEATURES)
    chosen = torch.rand(n, FEATURES, generator=g).argsort(dim=1)[:, :ACTIVE]
    codes.scatter_(1, chosen, 1 + 2 * torch.rand(n, ACTIVE, generator=g))
    return codes @ directions + 0.5, directions


def test_sae_recovers_planted_directions() -> None:
    data, directions = planted(6000)
    sae = train_sae(data[:5000], layer=3, settings=SaeSettings(d_sae=48, k=ACTIVE, steps=1500, batch_tokens=256, lr=3e-3), progress=False)
    decoder = torch.from_numpy(sae.W_dec)
    best = (directions @ decoder.T).max(dim=1).values  # each planted direction's closest latent (cosine)
    assert (best > 0.9).float().mean() >= 0.9, best
    report = evaluate_sae(sae, data[5000:], 5000)
    assert report.fraction_variance_explained > 0.9 and report.n_heldout_tokens == 1000
    assert 0 < report.mean_active <= ACTIVE and 0 <= report.dead_latents < 48


def write_capture(out: Path, rows: list[torch.Tensor], layer: int) -> Path:
    out.mkdir(parents=True)
    buffer = ShardBuffer([layer], max_rows=len(rows), max_bytes=1 << 30, n_images=1)
    for index, row in enumerate(rows):
        buffer.add(index, list(range(row.shape[0])), row[None])
    written: list[tuple[ShardRecord, list[RowRecord]]] = []
    writer = ShardWriter(out, 0, lambda shard, records: written.append((shard, records)), n_writers=1, direct=False)
    writer.submit(shard_name, *buffer.take())
    writer.close()
    [(shard, records)] = written
    manifest = CaptureManifest(
        model="synthetic",
        layers=[layer],
        dtype="float32",
        hidden_size=D,
        source="planted",
        source_sha256="0" * 64,
        n_prompts=len(rows),
        complete=True,
        shards=[shard],
        rows=records,
    )
    write_atomic(manifest_path(out), manifest.model_dump_json().encode())
    return out


def test_sae_from_a_capture_directory(tmp_path: Path) -> None:
    data, _ = planted(40 * 50, seed=1)
    rows = list(data.reshape(40, 50, D))
    rows[0][0] = 1e4  # an attention-sink-like first position: left out (skip_first=1)
    capture = write_capture(tmp_path / "capture", rows, layer=5)
    settings = SaeSettings(d_sae=48, k=ACTIVE, steps=600, batch_tokens=256, lr=3e-3)
    report = sae_from_capture(capture, 5, tmp_path / "sae", settings, skip_first=1, held_out=0.1, progress=False)
    assert report.n_heldout_tokens == 4 * 49 and report.n_train_tokens == 36 * 49
    assert report.fraction_variance_explained > 0.8
    sae = load_sae(tmp_path / "sae")
    assert (sae.layer, sae.architecture, sae.k, sae.d_in, sae.d_sae) == (5, "topk", ACTIVE, D, 48)
    assert json.loads((tmp_path / "sae" / "report.json").read_text())["dead_latents"] == report.dead_latents
    cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    assert cfg["model_name"] == "synthetic" and cfg["training"]["steps"] == 600
