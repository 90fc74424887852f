#!/usr/bin/env bash
# Copy the part of ../shared/data that the GPU scripts read into .sd/ (git-ignored), to be carried to the
# device machine (the device tool sends only the repo; ../shared does not travel).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"; src="$root/../shared/data"; dst="$root/.sd"
rm -rf "$dst"; mkdir -p "$dst/tokenizers" "$dst/datasets"
cp -r "$src/models" "$src/configs" "$src/README.md" "$dst/"
cp -r "$src/tokenizers/llama3" "$src/tokenizers/qwen2" "$dst/tokenizers/"  # qwen2: the Qwen3 servers (ep_serving)
chmod -R u+w "$dst"  # the shared copy is read-only
# the large tokenizer files travel gzipped (llama3 17 MB -> 2.5 MB, qwen2 16 MB -> 3.7 MB, so the slim NIXL wheel fits
# the 64 MiB carry beside them); device_preamble.sh unpacks every .gz under .sd on the device
gzip -9 "$dst/tokenizers/llama3/tokenizer.json" "$dst/tokenizers/qwen2/tokenizer.json" "$dst/tokenizers/qwen2/vocab.json" \
  "$dst/tokenizers/qwen2/merges.txt"
cp -r "$src/datasets/sharegpt" "$dst/datasets/"
du -sh "$dst"
