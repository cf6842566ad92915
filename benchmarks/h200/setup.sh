# Sourced at the start of every H200 call: megarl's wheels (shared/tools/gpu_wheels.sh) into
# /tmp/site, and this checkout on the path.
# once per machine: later calls of a warm lease find them installed
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
  && touch /tmp/site/.installed; } || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
