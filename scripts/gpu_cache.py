"""Carry vLLM's compilation caches from one lent GPU machine to the next (scripts/gpu_suite.sh).

A fresh machine builds its kernels anew: Triton's JIT-compiled kernels (the attention backends,
for the tests' fp32 engines too, which the plugin runs eager) and, in graph mode, torch.compile's
graphs and Inductor's kernels, all under ``TRITON_CACHE_DIR`` and ``VLLM_CACHE_ROOT`` (the suite
puts both under /tmp/kc). On 2026-12-04 the first engine of a fresh H200 took 149-173 s to
start and later engines of a new configuration ~7-30 s; the same configuration again, 3 s.

    python3 scripts/gpu_cache.py pack /tmp/kc $OUT      # kc.tar.gz.00, .01, ... (15 MiB each)
    python3 scripts/gpu_cache.py unpack DIR /tmp/kc     # DIR holds those pieces

``pack`` writes nothing if the compressed caches would exceed ``--max-mib`` (what comes back
from a device call: 8 files, 64 MiB); it prints the sizes either way. The pieces come back
under the call's files_at; copy them into ``.gpu-cache/`` (ignored by git) and carry that folder
in a call of its own before ``PART=prepare``, which unpacks it.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path

PIECE_BYTES = 15 * 2**20
PIECE_PREFIX = "kc.tar.gz."


def tree_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file() and not path.is_symlink())


def pack(root: Path, out: Path, max_mib: int) -> int:
    if not root.is_dir():
        print(f"no caches at {root}", file=sys.stderr)
        return 1
    for child in sorted(root.iterdir()):
        print(f"{child}: {tree_bytes(child) / 2**20:.1f} MiB")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:  # the standard library: no package to carry
        archive.add(str(root), arcname=".")
    packed = buffer.getvalue()
    print(f"compressed: {len(packed) / 2**20:.1f} MiB (at most {max_mib} MiB come back)")
    if len(packed) > max_mib * 2**20:
        print("too large to carry: nothing written", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    for number, start in enumerate(range(0, len(packed), PIECE_BYTES)):
        (out / f"{PIECE_PREFIX}{number:02d}").write_bytes(packed[start : start + PIECE_BYTES])
    return 0


def unpack(pieces_dir: Path, root: Path) -> int:
    pieces = sorted(pieces_dir.glob(f"{PIECE_PREFIX}*"))
    if not pieces:
        print(f"no cache pieces in {pieces_dir}: engines compile from scratch", file=sys.stderr)
        return 0
    packed = b"".join(piece.read_bytes() for piece in pieces)
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as archive:
        archive.extractall(str(root), filter="data")
    print(f"unpacked {len(pieces)} pieces ({len(packed) / 2**20:.1f} MiB) into {root}: {tree_bytes(root) / 2**20:.1f} MiB")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    pack_args = verbs.add_parser("pack", help="compress ROOT into pieces under OUT")
    pack_args.add_argument("root", type=Path)
    pack_args.add_argument("out", type=Path)
    pack_args.add_argument("--max-mib", type=int, default=60)
    unpack_args = verbs.add_parser("unpack", help="restore the pieces in DIR into ROOT")
    unpack_args.add_argument("dir", type=Path)
    unpack_args.add_argument("root", type=Path)
    args = parser.parse_args()
    if args.verb == "pack":
        return pack(args.root, args.out, args.max_mib)
    return unpack(args.dir, args.root)


if __name__ == "__main__":
    sys.exit(main())
