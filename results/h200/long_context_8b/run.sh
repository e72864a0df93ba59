#!/usr/bin/env bash
# The loop and the loss at long context, Llama-3.1-8B shape (model/, built from its public config), rank 0 of
# simulated N = 8, batch 1, full activation checkpointing, bf16 parameters with fp32 reduction. Run from the
# repository root: bash results/h200/long_context_8b/run.sh OUT "L:C ..." "LOOP:LOSS ..." [main.py flags...]
# Each launch writes OUT/L<L>_c<C>_<loop>_<loss>/ (summary.json, console.txt, the trace).
set -u
out=$1 lengths=$2 steps=$3
shift 3
for lc in $lengths; do
    for spec in $steps; do
        L=${lc%:*} C=${lc#*:} loop=${spec%:*} loss=${spec#*:}
        dir=$out/L${L}_c${C}_${loop}_${loss}
        mkdir -p "$dir"
        start=$SECONDS
        python3 main.py --model results/h200/long_context_8b/model --simulate_world_size 8 --batch_size 1 \
            --activation_checkpointing --mixed_precision_policy bf16_params_fp32_reduce --init_device cuda \
            --max_steps 2 --quiet --variants torch_optimizer_after_fsdp --block_size "$L" --cp_size "$C" \
            --loop "$loop" --loss "$loss" --output_dir "$dir" "$@" > "$dir/console.txt" 2>&1
        echo "L=$L C=$C $loop $loss: exit $? in $((SECONDS - start)) s"
    done
done
