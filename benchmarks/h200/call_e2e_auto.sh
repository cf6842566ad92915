# GPU call: one e2e shape that fits this card at megarl's defaults (the MoE slice's update takes
# ~112 GB: moe on a 139 GB H200, dense on an 80 GB H100), megarl's side or TRL's side.
#   usage: call_e2e_auto.sh megarl|trl [e2e_step.py args]
#   megarl: E2E_ARGS/E2E_TIMEOUT as e2e_megarl.sh; trl: the args go to call_trl.sh
total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
shape=$([ "${total:-0}" -gt 120000 ] && echo moe || echo dense)
echo "card memory ${total} MiB: shape $shape"
side=$1; shift
if [ "$side" = megarl ]; then bash benchmarks/h200/e2e_megarl.sh "$shape"
else bash benchmarks/h200/call_trl.sh "$shape" "$@"; fi
