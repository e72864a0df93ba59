#!/usr/bin/env bash
# The layout search for the Qwen2.5-7B shape (the qwen2.5-7b preset): N = 8 GPUs of 80 GiB, sequences of 32768 tokens,
# 8 sequences a step (262,144 tokens), every lever that runs on the machine (float8 where torchao imports, liger
# where installed).
# Timing launches (one simulated rank alone on the GPU, 6 steps each) by the defaults: the most promising first,
# then the ranked rows on top until three are measured (--max_timings 12, --time_budget_s 420). Run from the
# repository root:   bash results/h200/layout_7b/run.sh OUT
# Writes OUT/console.txt, OUT/plan.json.gz (every candidate), OUT/accelerate_config.json and OUT/layout.png
# (the timings stay in /tmp).
set -u
out=$1
mkdir -p "$out"
rm -rf /tmp/layout_7b
start=$SECONDS
python3 plan.py --find layout --model qwen2.5-7b --world_size 8 --gpu_memory 80 \
    --block_size 32768 --global_batch 8 --init_device cuda --output_dir /tmp/layout_7b \
    > "$out/console.txt" 2>&1
echo "plan.py: exit $? in $((SECONDS - start)) s" | tee -a "$out/console.txt"
python3 visualize.py --dir /tmp/layout_7b >> "$out/console.txt" 2>&1
gzip -c /tmp/layout_7b/plan.json > "$out/plan.json.gz"
cp /tmp/layout_7b/accelerate_config.json /tmp/layout_7b/layout.png "$out/" 2>/dev/null
