#!/usr/bin/env bash
# torchtitan's Llama-3.1-8B rows (local batch 2 x 8192, selective op checkpointing, bf16 parameters with fp32
# reduction) at N = 8 and 128 on one GPU, rank 0 of each simulated N, communication emulated every other step
# (--emulate_communication, the default links: 8-GPU nodes, NVLink 450 GB/s, a 400 Gb/s NIC a GPU): the
# compute-only and the emulated step of each row from one launch. torchao's wheel is installed first (float8).
# Run from the repository root:   bash results/h100/emulation_8b_one_launch/run.sh OUT ROW...   ROW: fsdp, compile, float8
set -u
out=$1
shift
python3 -m pip install -q --no-deps .device_wheels/torchao*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, accelerate, transformers, torchao, sys; print(torch.__version__, accelerate.__version__, \
transformers.__version__, torchao.__version__, sys.version.split()[0])" > "$out/versions.txt" 2>&1
run() {  # $1: the row's name; the rest: its flags beyond the common ones
    local name=$1
    shift
    mkdir -p "$out/$name"
    local start=$SECONDS
    python3 main.py --model results/h200/long_context_8b/model --simulate_world_size 8,128 --batch_size 2 \
        --block_size 8192 --mixed_precision_policy bf16_params_fp32_reduce --loop trainer --init_device cuda \
        --max_steps 10 --concurrent_variants 1 --quiet --variants torch_optimizer_after_fsdp \
        --activation_checkpointing selective --emulate_communication "$@" \
        --output_dir "/tmp/emulation_8b/$name" > "$out/$name/console.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
    cp "/tmp/emulation_8b/$name/summary.json" "$out/$name/"
}
for row in "$@"; do
    case $row in
        fsdp) run fsdp ;;
        compile) run compile --compile ;;
        float8) run float8 --compile --float8 ;;
        *) echo "unknown row $row"; exit 2 ;;
    esac
done
