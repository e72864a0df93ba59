#!/usr/bin/env bash
# torchtitan's Llama-3.1-8B rows (local batch 2 x 8192, selective op checkpointing, bf16 parameters with fp32
# reduction) at N = 8 and 128 on one GPU, rank 0 of each simulated N, communication emulated every other step with
# the default links, each collective's time now held by 16 CTAs that read and write its bytes (hold.py). ROW: fsdp,
# compile, float8, or compile_sleep (the compile row with the links' channels 0: the one-thread sleep, the baseline
# in the same lease). torchao's wheel is installed first (float8).
# Run from the repository root:   bash results/h100/emulation_8b_held/run.sh OUT ROW...
set -u
out=$1
shift
python3 -m pip install -q --no-deps .device_wheels/torchao*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, accelerate, transformers, torchao, triton, sys; print(torch.__version__, accelerate.__version__, \
transformers.__version__, torchao.__version__, triton.__version__, sys.version.split()[0])" > "$out/versions.txt" 2>&1
echo '{"node_size": 8, "within_gbps": 450, "across_gbps": 50, "channels": 0}' > /tmp/links_sleep.json
run() {  # $1: the row's name; the rest: its flags beyond the common ones
    local name=$1
    shift
    mkdir -p "$out/$name"
    local start=$SECONDS
    timeout 300 python3 main.py --model results/h200/long_context_8b/model --simulate_world_size 8,128 --batch_size 2 \
        --block_size 8192 --mixed_precision_policy bf16_params_fp32_reduce --loop trainer --init_device cuda \
        --max_steps 10 --concurrent_variants 1 --quiet --variants torch_optimizer_after_fsdp \
        --activation_checkpointing selective "$@" \
        --output_dir "/tmp/emulation_8b/$name" > "$out/$name/console.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
    cp "/tmp/emulation_8b/$name/summary.json" "$out/$name/"
}
for row in "$@"; do
    case $row in
        fsdp) run fsdp --emulate_communication ;;
        compile) run compile --compile --emulate_communication ;;
        float8) run float8 --compile --float8 --emulate_communication ;;
        compile_sleep) run compile_sleep --compile --emulate_communication /tmp/links_sleep.json ;;
        *) echo "unknown row $row"; exit 2 ;;
    esac
done
