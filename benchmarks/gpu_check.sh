#!/usr/bin/env bash
# The CUDA checks of issue 4, in one run on a machine with an NVIDIA GPU: the CUDA-only
# tests (half precision, int8/int4 weight-only via torchao, CUDA-graph decode steps and
# flow steps), then the flow's graphed steps against eager ones (benchmarks/flow_graphs.py),
# `cosyserve bench engine` on the full random model (bf16; streams with the incremental and
# the exact flow; fp16 + int4), and benchmarks/precision_quality.py on the GPU.
#
# Usage, from the repository root: bash benchmarks/gpu_check.sh OUT_DIR [STEP...]
# (no STEP: all of them; `init` is needed by every step after it).
# Needs a CUDA build of torch with cosyserve's runtime dependencies and torchao importable
# (on a machine without a registry: the wheels of benchmarks/gpu_wheels.sh)
# (PYTHONPATH=src works in place of an install). Each step has its own time limit, so one
# that hangs leaves the others their time; every step's output lands in OUT_DIR.
set -u -o pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [STEP...]}
shift
steps=" ${*:-env tests init flow-graphs bf16 bf16-stream bf16-stream-exact fp16-int4-stream precision} "
mkdir -p "$out"
model=${GPU_CHECK_MODEL_DIR:-/tmp/cosyserve-full}
cosyserve=(python3 -c 'import sys; from cosyserve.cli.main import main; sys.argv[0] = "cosyserve"; main()')
step() {  # step NAME SECONDS COMMAND...: run it under a limit, its output to OUT_DIR/NAME.txt
    local name=$1 limit=$2
    shift 2
    [[ $steps == *" $name "* ]] || return 0
    echo "== $name"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
export PYTHONUNBUFFERED=1

step env 60 python3 -c 'import torch, torchao; print(torch.__version__, torch.version.cuda, torchao.__version__, torch.cuda.get_device_name())'
step tests 240 python3 -m pytest -q -s -p no:cacheprovider -k "cuda or Cuda" \
    tests/accel/test_precision.py tests/engine/test_decode_graphs.py tests/models/flow/test_step_graph.py
step init 120 "${cosyserve[@]}" model init "$model" --size full --seed 0 --force
step flow-graphs 150 python3 benchmarks/flow_graphs.py --model-dir "$model" --json "$out/flow-graphs.json"
bench=(bench engine --model-dir "$model" --tokens 150 --no-progress)
# The auto plan on the GPU (bf16, CUDA graphs, exact flow chunks batched across streams,
# a 5-token first hop), then int4 LM weights over it.
step auto 150 "${cosyserve[@]}" "${bench[@]}" --device cuda --concurrency 1,8,16 --json "$out/auto.json"
step auto-stream 150 "${cosyserve[@]}" "${bench[@]}" --device cuda --stream \
    --concurrency 1,8,16 --json "$out/auto-stream.json"
step fp16-int4-stream 150 "${cosyserve[@]}" "${bench[@]}" --device cuda --dtype fp16 --quantize int4 --stream \
    --concurrency 1,16 --json "$out/fp16-int4-stream.json"
step precision 240 python3 benchmarks/precision_quality.py "$model" --device cuda --repeats 3 \
    --settings fp32,bf16,fp16,bf16+int8,bf16+int4 --out "$out/precision.json"
