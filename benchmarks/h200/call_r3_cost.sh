# GPU call (issue 30, R3's cost): the MoE e2e step twice on one warm card, router replay off,
# then actor.router_replay.mode=R3 (the JSON's moe_r3 holds r3_cost against moe). On an 80 GB
# card the slice is cut to MOE_LAYERS layers (the 8-layer slice's update needs ~94 GiB).
#   usage: MOE_LAYERS=4 bash benchmarks/h200/call_r3_cost.sh
args="--steps ${STEPS:-1} --moe-layers ${MOE_LAYERS:-8} ${E2E_EXTRA:-}"
E2E_ARGS="$args" E2E_TIMEOUT=${E2E_TIMEOUT:-240} bash benchmarks/h200/e2e_megarl.sh moe
R3=1 E2E_ARGS="$args" E2E_TIMEOUT=${E2E_TIMEOUT:-240} bash benchmarks/h200/e2e_megarl.sh moe
# a call returns 8 files at most: the logs go back as one archive
cd $OUT && tar czf logs_r3_cost.tgz --remove-files logs_moe.tgz logs_moe_r3.tgz mem_moe.log \
  mem_moe_r3.log estimates_test_moe.log steps_moe.jsonl steps_moe_r3.jsonl e2e_step_moe.png \
  2>/dev/null; ls $OUT
