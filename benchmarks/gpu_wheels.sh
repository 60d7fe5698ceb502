#!/usr/bin/env bash
# Downloads, into DIR, the wheels that benchmarks/gpu_check.sh needs on a GPU machine that
# has a CUDA build of torch (and numpy, onnx, onnxruntime, tokenizers, safetensors, pyyaml,
# typer) but no package registry: cosyserve's other runtime dependencies, the settings'
# pydantic, and torchao, for CPython 3.12 on x86-64 Linux.
#
# Usage, from the repository root, on a machine that reaches the registry:
#   bash benchmarks/gpu_wheels.sh DIR
# and there: pip install --no-index --no-deps --target SITE DIR/*.whl; PYTHONPATH=SITE:src.
set -eu -o pipefail
dir=${1:?usage: gpu_wheels.sh DIR}
python=${PYTHON:-.venv/bin/python}
wheels=(
    torchao==0.18.0 wetext==0.1.8 inflect==7.6.0 soundfile==0.14.0 soxr==1.1.0 av==18.1.0
    kaldi-native-fbank==1.23.0 pydantic==2.14.4 pydantic-settings==2.16.3
    # What those need in turn, at the versions the project's environment resolves.
    cffi pycparser kaldifst contractions textsearch anyascii pyahocorasick jaraco.functools
    more_itertools typeguard annotated-types typing-inspection python-dotenv
    "pydantic-core==$("$python" -c 'import importlib.metadata as m; print(m.version("pydantic-core"))')"
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    platforms+=(--platform "$p")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dir" "${wheels[@]}"
ls "$dir"
