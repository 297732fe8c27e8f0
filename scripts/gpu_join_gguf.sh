# Sourced on the device machine after scripts/gpu_stage_gguf.sh's calls: joins the GGUF's
# pieces from /tmp/gguf into /tmp/cache/models and exports TANDEM_CACHE=/tmp/cache.
name=$(cat .gpu/b/gguf.name)
mkdir -p /tmp/cache/models
cat /tmp/gguf/gguf.* > "/tmp/cache/models/$name"
if [ "$(md5sum < "/tmp/cache/models/$name" | cut -d' ' -f1)" != "$(cat .gpu/b/gguf.md5)" ]; then
  echo "gpu_join_gguf: $name does not match its checksum (a piece missing: make the calls again)"
  return 1
fi
export TANDEM_CACHE=/tmp/cache
echo "gpu_join_gguf: $name in $TANDEM_CACHE/models"
