# H200 call, on the machine that ran call_moe.sh (same code, same warm device): the MoE shape
# again with actor.router_replay.mode=R3; the JSON in /tmp/e2e then holds moe and moe_r3, and
# moe_r3 its r3_cost against moe (issue 30: at most 5% of step throughput).
R3=1 E2E_TIMEOUT=${E2E_TIMEOUT:-560} bash benchmarks/h200/e2e_megarl.sh moe
