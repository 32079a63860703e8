#!/usr/bin/env bash
# Builds .carry/ (ignored by git) for the lent H200, whose image lacks some of the project's dependencies and the
# bundled target (/work/.library/device/README.md):
#   .carry/whl/                 wheels for Python 3.12 of what the H200 lacks (DeepSpeed built here, pure Python)
#   .carry/c0/bpart00, c1/bpart01  the bundled SmolLM2 GGUF (98 MB) in two halves: a call carries 64 MiB at most
#   .carry/gguf.md5             the GGUF's checksum, checked when the halves are joined there
#   .carry/d/data.tgz           ../shared/data (the reference recipe's prompt files; 2.5 MB), when it is there
# Then, on the device, `benchmarks/device_call.sh` (carry .carry/whl and one of .carry/c0 / .carry/c1 per call;
# .carry/d with c0: whl, c0 and d together pass the 64 MiB a call may carry).
# Versions are the ones installed in PY's environment (default .venv, as `make test` builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PKGS="pydantic pydantic_core annotated_types typing_inspection hjson gguf datasets dill multiprocess datasketch"
mkdir -p .carry/whl .carry/c0 .carry/c1
pins=$($PY -m pip list --format=freeze 2>/dev/null | awk -F== -v want="$PKGS" '
  BEGIN { n = split(want, w, " "); for (i = 1; i <= n; i++) ok[tolower(w[i])] = 1 }
  { k = tolower($1); gsub("-", "_", k); if (k in ok) print $1 "==" $2 }')
[ "$(echo "$pins" | wc -l)" -eq "$(echo $PKGS | wc -w)" ] || { echo "missing in $PY's environment: $PKGS vs $pins" >&2; exit 1; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .carry/whl $pins
ds=$($PY -m pip list --format=freeze 2>/dev/null | grep -i '^deepspeed==')
python3 -m pip wheel -q --no-deps --no-build-isolation -w .carry/whl "$ds"
GGUF=$($PY -c "from specheads.target import bundled_gguf_path; print(bundled_gguf_path())")
split -b 49M -d -a 2 "$GGUF" .carry/bpart && mv .carry/bpart00 .carry/c0/ && mv .carry/bpart01 .carry/c1/
(cd "$(dirname "$GGUF")" && md5sum "$(basename "$GGUF")") > .carry/gguf.md5
if [ -d ../shared/data ]; then mkdir -p .carry/d && tar czf .carry/d/data.tgz -C ../shared data; fi
du -sh .carry/*
