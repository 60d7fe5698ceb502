#!/bin/sh
# The image's entry point: `cosyserve ARGS` (default: serve). Before `serve`, when
# FETCH_MODEL=missing (the image's default) and $COSYSERVE_MODEL_DIR holds no
# manifest.sha256 yet (an empty volume), the weights are fetched with `cosyserve download`
# (FETCH_SOURCE=modelscope for ModelScope; HF_ENDPOINT for a mirror); a failed download
# stops the start. FETCH_MODEL=never only serves what is there.
# `exec` makes cosyserve the process that receives SIGTERM, so a stop drains.
set -eu

case "${FETCH_MODEL:-never}" in
    missing | never) ;;
    *)
        echo "error: FETCH_MODEL must be missing or never, not '${FETCH_MODEL}'" >&2
        exit 2
        ;;
esac

if [ "$#" -eq 0 ]; then
    set -- serve
fi

if [ "$1" = "serve" ] && [ "${FETCH_MODEL:-never}" = "missing" ] \
    && [ ! -f "${COSYSERVE_MODEL_DIR:?COSYSERVE_MODEL_DIR is not set}/manifest.sha256" ]; then
    echo "no model in ${COSYSERVE_MODEL_DIR}: fetching it (FETCH_MODEL=never to skip)" >&2
    cosyserve download --dir "${COSYSERVE_MODEL_DIR}" --source "${FETCH_SOURCE:-huggingface}"
fi

exec cosyserve "$@"
