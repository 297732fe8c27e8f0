#!/bin/bash
# Stage the wheels that `tandem serve`, `mlx_lm server` and `tandem bench serve|compare` import,
# for the H200 device machine (Python 3.12, no package registry). Run from anywhere in the repo:
#
#   bash scripts/gpu_stage_serving.sh
#
# It runs ../shared/gpu/stage.sh (MLX CUDA in two halves, mlx, mlx-lm) with the serving stack
# below as extras in .gpu/b, then checks offline that every extra resolves for CPython 3.12.
#
# The versions are the ones in .venv (`pip freeze`), so the device runs what the tests ran.
# Not staged, because the device image has them (with transformers): numpy, transformers,
# tokenizers, safetensors, msgpack, jinja2, protobuf, pyyaml, huggingface_hub, regex, packaging,
# filelock. Not staged on purpose: matplotlib (compare then writes no PNGs; redraw them here
# with `tandem bench compare --replot DIR`), sentencepiece and pillow (optional imports).
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"

SERVING=(
  # tandem serve: HTTP process
  fastapi==0.165.0
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  annotated-doc==0.0.7
  typing-extensions==4.16.0
  typing-inspection==0.4.5
  opentelemetry-api==1.45.2
  uvicorn==0.55.0
  h11==0.16.0
  click==8.5.1
  pyzmq==27.3.0
  prometheus-client==0.26.0
  # the benchmark client (and tandem's own HTTP use)
  httpx==0.29.0
  httpcore==1.0.9
  anyio==4.16.0
  sniffio==1.3.1
  idna==3.20
  certifi==2026.10.19.post1
  tqdm==4.70.1
)
# Guided decoding (a core dependency). Its wheel is manylinux_2_31, a tag stage.sh does not
# ask for, so it is fetched here (the device's glibc is newer).
GUIDED=(llguidance==1.9.1)

bash ../shared/gpu/stage.sh "${SERVING[@]}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 -d .gpu/b "${GUIDED[@]}"
# The device's copy of the tree has no .git: scripts/h200_compare.sh records this instead.
dirty=$([ -z "$(git status --porcelain -- tandem)" ] || echo -dirty)
echo "$(git rev-parse HEAD)$dirty" > .gpu/b/tandem_commit

# Offline check for CPython 3.12 on manylinux x86-64: the serving stack resolves, its own
# requirements included, from .gpu/b alone; mlx and mlx-lm wheels are there (their other
# requirements are on the device image; the mlx-cuda wheel travels in halves, so not checked).
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
pip312() {  # .gpu/b alone: no config file, no PIP_* variables (find-links, index)
  PIP_CONFIG_FILE=/dev/null python3 -m pip --isolated install -q --dry-run --no-index --find-links .gpu/b --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    --target "$check/site" "$@"
}
pip312 "${SERVING[@]}" "${GUIDED[@]}"
pip312 --no-deps mlx==0.32.4 mlx-lm==0.32.2
python3 - "${SERVING[@]}" "${GUIDED[@]}" <<'EOF'
import sys
from pathlib import Path

have = {p.name.split("-")[0].lower().replace("_", "-") for p in Path(".gpu/b").glob("*.whl")}
want = {a.split("==")[0].lower().replace("_", "-") for a in sys.argv[1:]}
missing = sorted(want - have)
if missing:
    sys.exit(f"gpu_stage_serving: no wheel for {missing}")
print(f"gpu_stage_serving: {len(want)} serving wheels + mlx + mlx-lm in .gpu/b, all cp312-ready")
EOF
du -sh .gpu/a .gpu/b
