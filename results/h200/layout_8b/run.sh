#!/usr/bin/env bash
# The layout search for the Llama-3.1-8B shape (../long_context_8b/model): N = 64 GPUs of 80 GiB, sequences of 8192,
# 1024 sequences a step, every lever that runs on the machine (float8 where torchao imports, liger where installed).
# Timing launches (one simulated rank alone on the GPU, 6 steps each) by the defaults: the most promising first,
# then the ranked rows on top until three are measured (--max_timings 12), no timing started after 150 s of them
# (the session's device time left; the default is 420). Run from the
# repository root:   bash results/h200/layout_8b/run.sh OUT
# Writes OUT/console.txt, OUT/plan.json.gz (every candidate), OUT/accelerate_config.json and OUT/layout.png
# (the timings stay in /tmp).
set -u
out=$1
mkdir -p "$out"
rm -rf /tmp/layout_8b
start=$SECONDS
python3 plan.py --find layout --model results/h200/long_context_8b/model --world_size 64 --gpu_memory 80 \
    --block_size 8192 --global_batch 1024 --init_device cuda --time_budget_s 150 --output_dir /tmp/layout_8b \
    > "$out/console.txt" 2>&1
echo "plan.py: exit $? in $((SECONDS - start)) s" | tee -a "$out/console.txt"
python3 visualize.py --dir /tmp/layout_8b >> "$out/console.txt" 2>&1
gzip -c /tmp/layout_8b/plan.json > "$out/plan.json.gz"
cp /tmp/layout_8b/accelerate_config.json /tmp/layout_8b/layout.png "$out/" 2>/dev/null
