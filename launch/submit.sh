#!/bin/bash
# megarl on a running Ray cluster: submit `megarl train` as a Ray job (`ray job submit`).
#
# Usage:
#   RAY_ADDRESS=http://HEAD:8265 launch/submit.sh CONFIG [a.b.c=value ...]
#
# RAY_ADDRESS is the cluster's dashboard (job API) address; slurm/ray_on_slurm.slurm starts the
# dashboard when RAY_DASHBOARD_PORT is set, launch/local.sh likewise. This repository is uploaded as
# the job's working directory (without .git, .venv, outputs), so CONFIG must lie inside it and the
# uploaded code is what runs; the job attaches to its cluster with ray.address=auto. Give the
# model, data and trainer.output_dir as absolute paths on storage the cluster's nodes share: a
# relative path would point into the job's temporary copy. The script streams the job's logs
# until it ends and exits 0 when it succeeded.
#
# Environment:
#   RAY_ADDRESS     dashboard address of the cluster (required), e.g. http://10.0.0.1:8265
#   MEGARL_CMD      the job's command, run in the uploaded copy [python -m megarl.cli train]
#   SUBMISSION_ID   the job's id [Ray picks one]
#   NO_WAIT=1       return once submitted; follow with `ray job logs -f ID`
#   RAY_AUTH_TOKEN  the cluster's token when it uses token auth (RAY_AUTH_MODE=token)

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXCLUDES='[".git", ".venv", "outputs", "*.egg-info", "__pycache__", ".ruff_cache"]'

die() {  # an error line with its fix, then exit 1
    echo "megarl-submit: ERROR: $*" >&2
    exit 1
}

usage() {  # the header of this file
    sed -n '2,/^$/s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

config_in_repo() {  # CONFIG as a path relative to the repository root, or fail
    local config_abs
    config_abs="$(realpath -- "$1")"
    [[ "$config_abs" == "$REPO"/* ]] || die "config $1 is outside $REPO, so the job would not" \
        "see it; copy it into the repository (e.g. configs/)"
    echo "${config_abs#"$REPO"/}"
}

main() {
    (($# >= 1)) || usage
    [[ "$1" != -h && "$1" != --help ]] || usage
    [[ -f "$1" ]] || die "config $1 is not a file; pass a YAML file such as configs/qwen3-8b.yaml"
    [[ -n "${RAY_ADDRESS:-}" ]] || die "RAY_ADDRESS is not set; give the cluster's dashboard," \
        "e.g. RAY_ADDRESS=http://HEAD:8265 launch/submit.sh $1"
    command -v ray >/dev/null || die "the 'ray' command is not on PATH; activate megarl's" \
        "Python environment"
    local config cmd=() submit=()
    config="$(config_in_repo "$1")"
    shift
    read -ra cmd <<<"${MEGARL_CMD:-python -m megarl.cli train}"
    submit=(ray job submit --address "$RAY_ADDRESS" --working-dir "$REPO"
        --runtime-env-json "{\"excludes\": $EXCLUDES}")
    if [[ -n "${SUBMISSION_ID:-}" ]]; then submit+=(--submission-id "$SUBMISSION_ID"); fi
    if [[ "${NO_WAIT:-0}" == 1 ]]; then submit+=(--no-wait); fi
    echo "megarl-submit: ${cmd[*]} --config $config ray.address=auto $* -> $RAY_ADDRESS"
    exec "${submit[@]}" -- "${cmd[@]}" --config "$config" ray.address=auto "$@"
}

main "$@"
