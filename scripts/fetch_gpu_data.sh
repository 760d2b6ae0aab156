#!/usr/bin/env bash
# Copy, here, the offline data the GPU runs read into .data/ (ignored by git; name it in the run's
# carry: ../shared does not travel to the GPU machine). The runs use the COMPLETE WikiText-2
# train and validation splits in the tokenized `<unk>` variant (wikitext-2-v1): the raw variant
# the paper used has only a 1 MB train prefix offline. Checks the files against the data's README.
#   bash scripts/fetch_gpu_data.sh              # SPANATTN_DATA=... for another copy of ../shared/data
[ -n "${BASH_VERSION:-}" ] || { echo "fetch_gpu_data.sh: a bash script: run it as bash" \
                                     "scripts/fetch_gpu_data.sh" >&2; exit 2; }
set -euo pipefail
[ $# -eq 0 ] || { echo "fetch_gpu_data.sh: takes no arguments, got $* (SPANATTN_DATA=... names another data" \
                       "folder)" >&2; exit 2; }
DATA="${SPANATTN_DATA:-$(dirname "$0")/../../shared/data}"
[[ "$DATA" = /* ]] || DATA="$PWD/$DATA"  # a relative SPANATTN_DATA is read from where the script was called
cd "$(dirname "$0")/.."
mkdir -p .data/wikitext-2-v1 .data/gpt2-tokenizer
cp "$DATA"/wikitext-2-v1/train.txt "$DATA"/wikitext-2-v1/validation.txt .data/wikitext-2-v1/
cp "$DATA"/gpt2-tokenizer/* .data/gpt2-tokenizer/
chmod -R u+w .data
sha256sum -c <<SUMS
9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f  .data/wikitext-2-v1/train.txt
f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8  .data/wikitext-2-v1/validation.txt
311f7262f89ffe8757683fda3c081a5cac5a885dc311264791a17d2a18499a4f  .data/gpt2-tokenizer/tokenizer.json
SUMS
du -sh .data
