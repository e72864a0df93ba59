#!/usr/bin/env bash
# Fine-tuning under FSDP2 on one GPU: LoRA and QLoRA (peft, bitsandbytes), AdamW and torchao's 8-bit AdamW, all four
# variants at 1.5B on one real rank; QLoRA's uint8 storage run anyway; the Llama-3.1-8B shape at simulated N = 8, 8192
# tokens, LoRA / QLoRA / full fine-tuning. bitsandbytes' and torchao's wheels are installed first (the image has
# peft). Run from the repository root:   bash results/h100/fine_tuning/run.sh OUT RUN...
set -u
out=$1
shift
# bitsandbytes's wheel carried with only its CUDA 13 and CPU libraries (the image has torch 2.11+cu130)
python3 -m pip install -q --no-deps .device_wheels/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, accelerate, transformers, peft, bitsandbytes, torchao, sys; print(torch.__version__, \
accelerate.__version__, transformers.__version__, peft.__version__, bitsandbytes.__version__, torchao.__version__, \
sys.version.split()[0])" > "$out/versions.txt" 2>&1
run() {  # $1: the run's name; the rest: main.py's flags
    local name=$1
    shift
    mkdir -p "$out/$name"
    local start=$SECONDS
    python3 main.py "$@" --quiet --output_dir "/tmp/fine_tuning/$name" > "$out/$name/console.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
    cp "/tmp/fine_tuning/$name/summary.json" "$out/$name/" 2>/dev/null
}
B15="--model qwen2.5-1.5b --max_steps 40 --learning_rate 2e-4"  # a LoRA learning rate: the default 3e-5 barely moves adapters
B8="--model llama-3.1-8b --simulate_world_size 8 --block_size 8192 --batch_size 1 --loop trainer --max_steps 6 \
    --init_device cuda --variants torch_optimizer_after_fsdp"
for name in "$@"; do
    case $name in
        lora) run lora $B15 --peft lora ;;
        qlora) run qlora $B15 --peft qlora ;;
        lora_8bit) run lora_8bit $B15 --peft lora --optimizer adamw8bit --variants torch_optimizer_after_fsdp,accelerate ;;
        qlora_uint8) run qlora_uint8 $B15 --peft qlora --qlora_storage uint8 --allow_known_failure \
                         --variants torch_optimizer_after_fsdp,accelerate ;;
        8b_full) run 8b_full $B8 --activation_checkpointing full ;;
        8b_lora) run 8b_lora $B8 --peft lora ;;
        8b_qlora_8bit) run 8b_qlora_8bit $B8 --peft qlora --optimizer adamw8bit ;;  # refused since (torchao on bf16)
        8b_qlora) run 8b_qlora $B8 --peft qlora ;;
        8b_lora_ac) run 8b_lora_ac $B8 --peft lora --activation_checkpointing full ;;
        8b_lora_8bit) run 8b_lora_8bit $B8 --peft lora --optimizer adamw8bit --activation_checkpointing full ;;
        *) echo "unknown run $name"; exit 2 ;;
    esac
done
