#!/usr/bin/env bash
# Copy the part of ../shared/data that the GPU scripts read into .sd/ (git-ignored), to be carried to the
# device machine (the device tool sends only the repo; ../shared does not travel).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"; src="$root/../shared/data"; dst="$root/.sd"
rm -rf "$dst"; mkdir -p "$dst/tokenizers" "$dst/datasets"
cp -r "$src/models" "$src/configs" "$src/README.md" "$dst/"
cp -r "$src/tokenizers/llama3" "$dst/tokenizers/"
# tokenizer.json travels gzipped (17 MB -> 2.5 MB, so the slim NIXL wheel fits the 64 MiB carry beside it);
# device_preamble.sh unpacks every .gz under .sd on the device
gzip -9 "$dst/tokenizers/llama3/tokenizer.json"
cp -r "$src/datasets/sharegpt" "$dst/datasets/"
du -sh "$dst"
