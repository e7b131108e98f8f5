#!/usr/bin/env bash
# Fetch, here (a machine that reaches the package index), the Python packages benchmarks/gpu/run.sh
# needs on the GPU machine that its image lacks: hydra-core, omegaconf and antlr4 as Python 3.12
# wheels (pure Python, ~0.4 MB together) into benchmarks/gpu/wheels/ (ignored by git: the device
# tool's run carries it with carry=["benchmarks/gpu/wheels"]). Not wandb: the check runs
# logger=none, which never imports it. The image's own torch, transformers, tokenizers,
# safetensors, PyYAML, tqdm, filelock and cloudpickle are used as they are.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
rm -rf wheels
mkdir -p wheels
"$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp --no-deps -d wheels \
    hydra-core==1.3.8 omegaconf==2.3.1
# antlr4-python3-runtime 4.9.3, the version hydra-core 1.3 and omegaconf 2.3 pin, is published as an
# sdist only: build its wheel (pure Python, py3-none-any: it installs on 3.12 as it is)
"$PY" -m pip wheel --no-deps -w wheels antlr4-python3-runtime==4.9.3
ls -l wheels
