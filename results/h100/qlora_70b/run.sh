#!/usr/bin/env bash
# Llama-3.1-70B QLoRA under FSDP2, one simulated rank of N = 2, 4 and 8 on one GPU, the base built unit by unit on
# meta and quantized as each block is sharded (--init_device meta); with and without CPU offload. Also the 1.5B LoRA
# four variants at simulated N = 8. bitsandbytes' wheel is installed first (the image has peft). Run from the
# repository root:   bash results/h100/qlora_70b/run.sh OUT RUN...
set -u
out=$1
shift
python3 -m pip install -q --no-deps .device_wheels/bitsandbytes*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, accelerate, transformers, peft, bitsandbytes, sys; print(torch.__version__, \
accelerate.__version__, transformers.__version__, peft.__version__, bitsandbytes.__version__, sys.version.split()[0])" \
    > "$out/versions.txt" 2>&1
run() {  # $1: the run's name; the rest: main.py's flags
    local name=$1
    shift
    mkdir -p "$out/$name"
    local start=$SECONDS
    python3 main.py "$@" --quiet --output_dir "/tmp/qlora_70b/$name" > "$out/$name/console.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
    cp "/tmp/qlora_70b/$name/summary.json" "$out/$name/" 2>/dev/null
}
Q70="--model llama-3.1-70b --peft qlora --init_device meta --variants torch_optimizer_after_fsdp \
     --activation_checkpointing full --block_size 4096 --batch_size 1 --loop trainer --max_steps 4"
for name in "$@"; do
    case $name in
        70b) run 70b $Q70 --simulate_world_size 2,4,8 ;;
        70b_offload) run 70b_offload $Q70 --simulate_world_size 2,4,8 --cpu_offload ;;
        lora_n8) run lora_n8 --model qwen2.5-1.5b --peft lora --simulate_world_size 8 --max_steps 12 ;;
        *) echo "unknown run $name"; exit 2 ;;
    esac
done
