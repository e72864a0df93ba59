#!/usr/bin/env bash
# The levers on the Llama-3.1-8B shape (../long_context_8b/model, built from its public config): local batch
# 2 x 8192, bf16 parameters with fp32 reduction, the Trainer's loop and the model's loss, rank 0 of simulated
# N = 8 and 128, one run at a time (clean speed figures). Run from the repository root:
#   bash results/h200/levers_8b/run.sh OUT ROW...   ROW: full, selective, selective_compile, selective_compile_float8
# Each row writes OUT/ROW/summary.json and OUT/ROW/console.txt (the traces stay in /tmp/levers_8b/ROW).
set -u
out=$1
shift
for row in "$@"; do
    case $row in
        full) flags="--activation_checkpointing full" ;;
        selective) flags="--activation_checkpointing selective" ;;
        selective_compile) flags="--activation_checkpointing selective --compile" ;;
        selective_compile_float8) flags="--activation_checkpointing selective --compile --float8" ;;
        *) echo "unknown row $row"; exit 2 ;;
    esac
    mkdir -p "$out/$row"
    start=$SECONDS
    python3 main.py --model results/h200/long_context_8b/model --simulate_world_size 8,128 --batch_size 2 \
        --block_size 8192 --mixed_precision_policy bf16_params_fp32_reduce --loop trainer --init_device cuda \
        --max_steps 6 --concurrent_variants 1 --quiet --variants torch_optimizer_after_fsdp $flags \
        --output_dir "/tmp/levers_8b/$row" > "$out/$row/console.txt" 2>&1
    echo "$row: exit $? in $((SECONDS - start)) s"
    cp "/tmp/levers_8b/$row/summary.json" "$out/$row/"
done
