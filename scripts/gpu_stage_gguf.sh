#!/bin/bash
# Stage the default model's GGUF (98 MB) for the device machine, whose calls carry at most
# 64 MiB with the working tree: the file in pieces beside the two MLX halves, joined there
# into $TANDEM_CACHE/models. Run after scripts/gpu_stage_serving.sh, from anywhere in the repo:
#
#   bash scripts/gpu_stage_gguf.sh
#
# The device calls that follow (each within 30 s of the last, or the machine and /tmp go):
#   1. carry .gpu/a .gpu/g1:  mkdir -p /tmp/gpu /tmp/gguf && cp .gpu/a/* /tmp/gpu/ && cp .gpu/g1/* /tmp/gguf/
#   2. carry .gpu/g2:         cp .gpu/g2/* /tmp/gguf/
#   3. carry .gpu/g3 (if made): cp .gpu/g3/* /tmp/gguf/
#   4. carry .gpu/b:          source .gpu/b/install.sh && source scripts/gpu_join_gguf.sh && ...
# then TANDEM_CACHE=/tmp/cache holds the default model (tandem bench speculative, the report's
# spec-ngram entry).
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
gguf=${GGUF:-${TANDEM_CACHE:-$HOME/.cache/tandem}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$gguf" ] || { echo "no $gguf: run scripts/setup.sh first (it fetches the default model)"; exit 1; }
[ -d .gpu/a ] && [ -d .gpu/b ] || { echo "run scripts/gpu_stage_serving.sh first"; exit 1; }
limit=$((64 << 20))
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
margin=$((2 << 20))  # untracked files, rounding
room_a=$((limit - tree - margin - $(du -sb .gpu/a | cut -f1)))
room=$((limit - tree - margin))
size=$(stat -c %s "$gguf")
rm -rf .gpu/g1 .gpu/g2 .gpu/g3
mkdir -p .gpu/g1 .gpu/g2 .gpu/g3
piece() {  # $1: file, $2: first byte, $3: bytes
  dd if="$gguf" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" count="$3" status=none
}
piece .gpu/g1/gguf.1 0 "$room_a"
piece .gpu/g2/gguf.2 "$room_a" "$room"
if [ "$size" -gt $((room_a + room)) ]; then
  piece .gpu/g3/gguf.3 $((room_a + room)) "$room"
else
  rmdir .gpu/g3
fi
md5sum < "$gguf" | cut -d' ' -f1 > .gpu/b/gguf.md5
basename "$gguf" > .gpu/b/gguf.name
cat .gpu/g*/gguf.* | md5sum | cut -d' ' -f1 | cmp -s - .gpu/b/gguf.md5 \
  || { echo "gpu_stage_gguf: the pieces do not join back to $gguf"; exit 1; }
du -sh .gpu/g*
echo "gpu_stage_gguf: $(ls -d .gpu/g* | wc -l) pieces; join them on the device with" \
  "'source scripts/gpu_join_gguf.sh' (after the call that carries .gpu/b)"
