#!/usr/bin/env bash
# Issue 59's case: two 1.5B variants at batch 4 x 4096, rank 0 of simulated N = 8, on one H200. Run from the
# repository root: bash results/h200/concurrency_oom/run.sh OUT
#   OUT/auto/:   --concurrent_variants auto, the command of the issue (each run needs about 96 GiB by the
#                planner's rule: expected one at a time, both ok, exit 0)
#   OUT/shared/: --concurrent_variants 2, the two forced side by side as the old estimate (36.4 GiB) ran them:
#                expected one out of memory, run again alone, reported ok with rerun_alone_after, exit 0
#   OUT/alone/:  --concurrent_variants 1, the figures alone to compare
# Each writes summary.json and console.txt (the traces stay in /tmp/concurrency_oom); times.txt says each launch's
# exit code and seconds.
set -u
out=$1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt"
for spec in auto:auto shared:2 alone:1; do
    name=${spec%:*} k=${spec#*:}
    mkdir -p "$out/$name"
    start=$SECONDS
    python3 main.py --model qwen2.5-1.5b --simulate_world_size 8 --batch_size 4 --block_size 4096 \
        --variants torch_optimizer_after_fsdp,accelerate --concurrent_variants "$k" \
        --output_dir "/tmp/concurrency_oom/$name" > "$out/$name/console.txt" 2>&1
    echo "$name (--concurrent_variants $k): exit $? in $((SECONDS - start)) s" | tee -a "$out/times.txt"
    cp "/tmp/concurrency_oom/$name/summary.json" "$out/$name/"
done
