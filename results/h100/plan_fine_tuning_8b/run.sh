#!/usr/bin/env bash
# The planner's answer for fine-tuning: the largest batch of the Llama-3.1-8B shape under QLoRA (full activation
# checkpointing, the intended variant) that fits one of 8 GPUs capped at 24 and at 40 GB, at 2048 and 4096 tokens.
# Each plan is stopped after LIMIT seconds with SIGINT (plan.json keeps what its probes measured). bitsandbytes' wheel
# is installed first. Run from the repository root:
#   bash results/h100/plan_fine_tuning_8b/run.sh OUT LIMIT PEFT:CAP...    e.g. qlora:24GB qlora:40GB
set -u
out=$1
limit=$2
shift 2
python3 -m pip install -q --no-deps .device_wheels/bitsandbytes*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, accelerate, transformers, peft, bitsandbytes, sys; print(torch.__version__, \
accelerate.__version__, transformers.__version__, peft.__version__, bitsandbytes.__version__, sys.version.split()[0])" \
    > "$out/versions.txt" 2>&1
for asked in "$@"; do
    IFS=: read -r peft cap <<< "$asked"
    name="8b_${peft}_${cap}"
    mkdir -p "$out/$name"
    start=$SECONDS
    timeout -s INT "$limit" python3 plan.py --model llama-3.1-8b --world_size 8 --gpu_memory "$cap" --sets ac \
        --variants torch_optimizer_after_fsdp --block_size 2048,4096 --peft "$peft" \
        --output_dir "/tmp/plan_ft/$name" > "$out/$name/console.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
    gzip -c "/tmp/plan_ft/$name/plan.json" > "$out/$name/plan.json.gz" 2>/dev/null
done
