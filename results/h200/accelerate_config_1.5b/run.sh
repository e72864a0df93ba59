#!/usr/bin/env bash
# A user's accelerate config measured, Qwen2.5-1.5B shape, one GPU: under accelerate launch (N = 1, all four
# variants; accelerate launch as python3 -m accelerate.commands.launch), with --config_file at simulated N = 8,
# and the same options given as flags at N = 8 (the same run).
# Run from the repository root: bash results/h200/accelerate_config_1.5b/run.sh OUT [main.py flags...]
set -u
out=$1
shift
here=results/h200/accelerate_config_1.5b
run() {
    local name=$1
    shift
    mkdir -p "$out/$name"
    local start=$SECONDS
    "$@" > "$out/$name/console.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
}
run launch python3 -m accelerate.commands.launch --config_file $here/fsdp2.yaml main.py --model qwen2.5-1.5b --max_steps 20 \
    --output_dir "$out/launch" "$@"
run config_n8 python3 main.py --config_file $here/fsdp2.yaml --model qwen2.5-1.5b --simulate_world_size 8 \
    --output_dir "$out/config_n8" "$@"
run flags_n8 python3 main.py --reshard_after_forward false --activation_checkpointing --mixed_precision_policy fp32 \
    --model qwen2.5-1.5b --simulate_world_size 8 --output_dir "$out/flags_n8" "$@"
