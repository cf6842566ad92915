#!/bin/bash
# megarl on one machine: start (or attach to) a local Ray, then run `megarl train` against it.
#
# Usage:
#   launch/local.sh CONFIG [a.b.c=value ...]
#   e.g. launch/local.sh configs/tiny-moe-cpu.yaml trainer.total_steps=2
#
# When nothing listens on RAY_PORT, the script starts a private Ray head (its own temp dir, no
# dashboard unless RAY_DASHBOARD_PORT is set) with NUM_CPUS / NUM_GPUS, runs the command with
# ray.address=127.0.0.1:RAY_PORT and ray.num_cpus=NUM_CPUS, and stops that head when it exits.
# When a Ray already answers on RAY_PORT, it attaches to it and says so; if that Ray is a stale
# one, stop it with `ray stop` (or choose another RAY_PORT). A port held by something that is not
# Ray stops the script with a message.
#
# Environment (all optional):
#   MEGARL_CMD           the command to run [megarl train]
#   RAY_PORT             GCS port of the local head [6379]
#   RAY_NODE_MANAGER_PORT, RAY_OBJECT_MANAGER_PORT, RAY_RUNTIME_ENV_AGENT_PORT,
#   RAY_DASHBOARD_AGENT_GRPC_PORT, RAY_DASHBOARD_AGENT_LISTEN_PORT, RAY_METRICS_EXPORT_PORT,
#   RAY_CLIENT_SERVER_PORT, RAY_MIN_WORKER_PORT, RAY_MAX_WORKER_PORT
#                        the started head's other ports, when set [Ray's defaults]; set them
#                        when another Ray on this machine holds those defaults
#   NUM_CPUS, NUM_GPUS   what the started head offers [all CPUs; the GPUs nvidia-smi lists]
#   RAY_DASHBOARD_PORT   also start the dashboard on this port (for `ray job submit`)
#   RAY_TEMP_DIR         the started head's temp/log dir [/tmp/ray-local-<pid>]
#   RAY_START_TIMEOUT_S  seconds to wait for the started head [120]
#   RAY_AUTH_MODE        unset = a started head uses token auth with a fresh RAY_AUTH_TOKEN, and an
#                        attach uses ~/.ray/auth_token when it exists; token or disabled as given

set -euo pipefail

# Ray workers at the driver's priority, as megarl's own local Ray runs them (ray_init.py): Ray's
# default niceness 15 leaves train ranks and engines a few percent of a busy CPU.
export RAY_worker_niceness=0

LOG_PREFIX="megarl-local:"
RAY_HEAD_PID=""

log() {  # one line on stdout
    echo "$LOG_PREFIX $*"
}

die() {  # an error line with its fix, then exit 1
    echo "$LOG_PREFIX ERROR: $*" >&2
    exit 1
}

usage() {  # the header of this file
    sed -n '2,/^$/s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

port_open() {  # whether something accepts TCP connections on 127.0.0.1:$1
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

gpu_count() {  # GPUs visible to this process: CUDA_VISIBLE_DEVICES, else nvidia-smi's list
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        local ids
        IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
        echo "${#ids[@]}"
    elif command -v nvidia-smi >/dev/null; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

# `ray start` flag <- environment variable, passed when the variable is set (see the header).
PORT_FLAGS=(node-manager-port:RAY_NODE_MANAGER_PORT object-manager-port:RAY_OBJECT_MANAGER_PORT
    runtime-env-agent-port:RAY_RUNTIME_ENV_AGENT_PORT
    dashboard-agent-grpc-port:RAY_DASHBOARD_AGENT_GRPC_PORT
    dashboard-agent-listen-port:RAY_DASHBOARD_AGENT_LISTEN_PORT
    metrics-export-port:RAY_METRICS_EXPORT_PORT ray-client-server-port:RAY_CLIENT_SERVER_PORT
    min-worker-port:RAY_MIN_WORKER_PORT max-worker-port:RAY_MAX_WORKER_PORT)

start_head() {  # a private `ray start --head --block` in the background; sets RAY_HEAD_PID
    local port="$1" cpus="$2" gpus="$3" temp_dir="$4"
    local args=(--head --block --disable-usage-stats --port="$port"
        --num-cpus="$cpus" --num-gpus="$gpus" --temp-dir="$temp_dir")
    if [[ -n "${RAY_DASHBOARD_PORT:-}" ]]; then
        args+=(--include-dashboard=true --dashboard-port="$RAY_DASHBOARD_PORT")
    else
        args+=(--include-dashboard=false)
    fi
    local pair var
    for pair in "${PORT_FLAGS[@]}"; do
        var="${pair#*:}"
        if [[ -n "${!var:-}" ]]; then args+=("--${pair%%:*}=${!var}"); fi
    done
    if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
        export RAY_AUTH_MODE=token
        RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}"
        export RAY_AUTH_TOKEN
    fi
    log "starting a private Ray head on 127.0.0.1:$port ($cpus CPUs, $gpus GPUs, logs in $temp_dir)"
    ray start "${args[@]}" &
    RAY_HEAD_PID=$!
    local deadline=$((SECONDS + ${RAY_START_TIMEOUT_S:-120}))
    until port_open "$port"; do
        kill -0 "$RAY_HEAD_PID" 2>/dev/null || die "the Ray head exited before it listened on" \
            "port $port (see its output above); set RAY_PORT to a free port"
        ((SECONDS < deadline)) || die "the Ray head did not listen on port $port within" \
            "${RAY_START_TIMEOUT_S:-120}s; raise RAY_START_TIMEOUT_S or read $temp_dir"
        sleep 1
    done
}

check_temp_dir() {  # Ray's socket paths (temp dir + ~70 chars) must fit in 107 bytes
    ((${#1} <= 35)) || die "RAY_TEMP_DIR=$1 is ${#1} characters; Ray's socket paths under it" \
        "would exceed 107 bytes, so use a path of at most 35 characters such as /tmp/ray-\$USER"
}

stop_head() {  # stop the head this script started (SIGTERM makes `ray start --block` clean up)
    [[ -n "$RAY_HEAD_PID" ]] || return 0
    log "stopping the private Ray head"
    kill -TERM "$RAY_HEAD_PID" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while kill -0 "$RAY_HEAD_PID" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    kill -KILL "$RAY_HEAD_PID" 2>/dev/null || true
}

check_attach() {  # check that the Ray on port $1 answers, and say how to get rid of it
    local port="$1"
    if [[ -z "${RAY_AUTH_MODE:-}" && -f "$HOME/.ray/auth_token" ]]; then
        export RAY_AUTH_MODE=token  # what `ray start` chose when it found this token
    fi
    ray status --address "127.0.0.1:$port" >/dev/null 2>&1 || die "port $port is in use, but" \
        "not by a Ray this script can reach (a stale Ray, or one with another auth token);" \
        "stop it (\`ray stop\`), set RAY_AUTH_TOKEN, or set RAY_PORT to a free port"
    log "attaching to the Ray already running on 127.0.0.1:$port (if it is stale, stop it with" \
        "\`ray stop\` and run again, or set RAY_PORT to start a private one)"
}

main() {
    (($# >= 1)) || usage
    [[ "$1" != -h && "$1" != --help ]] || usage
    local config="$1"
    shift
    [[ -f "$config" ]] || die "config $config is not a file; pass a YAML file such as" \
        "configs/tiny-moe-cpu.yaml"
    command -v ray >/dev/null || die "the 'ray' command is not on PATH; activate megarl's" \
        "Python environment (e.g. source .venv/bin/activate)"
    local port="${RAY_PORT:-6379}" cmd=() overrides=()
    read -ra cmd <<<"${MEGARL_CMD:-megarl train}"

    if port_open "$port"; then
        check_attach "$port"
    else
        local cpus gpus temp_dir="${RAY_TEMP_DIR:-/tmp/ray-local-$$}"
        cpus="${NUM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
        gpus="${NUM_GPUS:-$(gpu_count)}"
        check_temp_dir "$temp_dir"
        trap stop_head EXIT
        trap 'exit 143' TERM INT
        start_head "$port" "$cpus" "$gpus" "$temp_dir"
        overrides+=("ray.num_cpus=$cpus")
    fi
    overrides=("ray.address=127.0.0.1:$port" "${overrides[@]}")
    log "running: ${cmd[*]} --config $config ${overrides[*]} $*"
    "${cmd[@]}" --config "$config" "${overrides[@]}" "$@"
}

main "$@"
