#!/usr/bin/env bash
# The levers' order per variant, read back (applied.block_nesting) with dynamo's graph breaks and the speed, and
# TP's functional collectives under emulation: Qwen2.5-1.5B shape, rank 0 of simulated N = 8, batch 2 x 2048.
# Run from the repository root:  bash results/h100/accelerate_order/run.sh OUT RUN...
#   RUN: selective (selective AC + compile), full (whole-block AC + compile: accelerate's own plugin),
#        tp (TP 2 x 4 shards, communication emulated), tp_compile (the same, compiled)
set -u
out=$1
shift
nvidia-smi --query-gpu=name,power.limit,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, accelerate, transformers, sys; print(torch.__version__, accelerate.__version__, \
transformers.__version__, sys.version.split()[0])" > "$out/versions.txt"
run() {  # $1: the run's name; the rest: its flags beyond the common ones
    local name=$1
    shift
    mkdir -p "$out/$name"
    local start=$SECONDS
    python3 main.py --model qwen2.5-1.5b --simulate_world_size 8 --batch_size 2 --block_size 2048 --max_steps 6 \
        --loop trainer --mixed_precision_policy bf16_params_fp32_reduce --init_device cuda --concurrent_variants 1 \
        --quiet "$@" --output_dir "/tmp/accelerate_order/$name" > "$out/$name/console.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
    cp "/tmp/accelerate_order/$name/summary.json" "$out/$name/"
}
for name in "$@"; do
    case $name in
        selective) run selective --variants torch_optimizer_after_fsdp,accelerate \
                       --activation_checkpointing selective --compile ;;
        full) run full --variants torch_optimizer_after_fsdp,accelerate --activation_checkpointing full --compile ;;
        tp) run tp --variants torch_optimizer_after_fsdp --tp_size 2 --emulate_communication ;;
        tp_compile) run tp_compile --variants torch_optimizer_after_fsdp --tp_size 2 --compile --emulate_communication ;;
        *) echo "unknown run $name"; exit 2 ;;
    esac
done
