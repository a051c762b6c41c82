"""Readout weights from the frontend to its workers through a file, once per digest.

A request's wire travels through msgpack on the frontend, a socket to the engine core, msgpack
again, and the engine core's broadcast to its workers: a tuned lens of an 8B model (32 x 4096 x
4096 float32, 2 GiB) sent inline with every request would stall every step of the engine. When the
workers share the frontend's host (``compat.config.workers_share_host``) and the hand-off is on,
the frontend instead writes each digest's weights once into the hand-off directory
(``handoff_files``: a name carrying this host's token, the frontend's pid and the digest; mode 0600)
as safetensors, and a request names them by ``{"digest": ..., "file": ...}`` alone. A worker
reads the file only when its device cache (``worker/readouts.py``) does not hold the digest, from a
regular file of this user only, and checks that the weights it read have that digest.

The frontend deletes a file when its digest has left the frontend's cache and no request in
flight names it (``transport/readout_cache.py``), at exit, and the hand-off sweep deletes those a
dead frontend left. Nothing is unpickled: safetensors holds the arrays, JSON the other fields."""

from __future__ import annotations

import json
import os
import re

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays

from lens_evals.engine.transport.handoff_files import NAMESPACE, WEIGHTS_PREFIX, ForeignFile, open_own, remove
from lens_evals.request.readouts import AffineLens, SaeEncoder

Weights = AffineLens | SaeEncoder
_KINDS: dict[str, type[Weights]] = {"affine": AffineLens, "sae": SaeEncoder}
WEIGHTS_NAME = re.compile(rf"^{WEIGHTS_PREFIX}{NAMESPACE}-([0-9]+)-([0-9a-f]{{64}})$")  # the frontend's pid, the digest


def file_name(digest: str) -> str:
    return f"{WEIGHTS_PREFIX}{NAMESPACE}-{os.getpid()}-{digest}"


def _kind(weights: Weights) -> str:
    return "affine" if isinstance(weights, AffineLens) else "sae"


def write(directory: str, weights: Weights) -> str:
    """Write ``weights`` (inline) to a new file in ``directory``; its path. Written under a
    temporary name and renamed, so a reader never sees a partial file."""
    digest = weights.content_digest()
    arrays = {name: np.ascontiguousarray(a) for name in weights.arrays if (a := getattr(weights, name)) is not None}
    fields = weights.model_dump(exclude={*weights.arrays, "digest"})
    data = save_arrays(arrays, metadata={"kind": _kind(weights), "fields": json.dumps(fields)})
    path = os.path.join(directory, file_name(digest))
    partial = f"{path}.{os.urandom(4).hex()}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(partial, path)
    except BaseException:
        remove(partial)
        raise
    return path


def read(path: str, digest: str) -> Weights:
    """The weights the frontend wrote to ``path`` for ``digest``; ValueError (that request fails
    alone) for a name not ours, a file that is not a regular file of this user, one that is gone
    or unreadable, or weights of another digest."""
    match = WEIGHTS_NAME.match(os.path.basename(path))
    if match is None or match.group(2) != digest:
        raise ValueError(f"readout weights file {os.path.basename(path)!r} is not a lens_evals weights file for digest {digest[:12]}...")
    try:
        fd = open_own(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ValueError(
            f"readout weights {digest[:12]}... are gone from {os.path.dirname(path)} (the frontend dropped them): send them inline again"
        ) from None
    except (OSError, ForeignFile) as exc:
        raise ValueError(f"readout weights file {path} cannot be read here ({exc})") from None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read()
    try:
        arrays = load_arrays(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        cls = _KINDS[metadata["kind"]]
        fields = json.loads(metadata["fields"])
        weights = cls.model_validate({**fields, **arrays})
    except (KeyError, ValueError, TypeError, SafetensorError) as exc:
        raise ValueError(f"readout weights file {path} is malformed ({exc})") from None
    if weights.content_digest() != digest:
        raise ValueError(f"readout weights file {path} holds other weights than digest {digest[:12]}...")
    return weights
