#!/usr/bin/env bash
# The planner's answer for Llama-3.1-70B QLoRA: the largest batch (full activation checkpointing, the intended
# variant) that fits one of N GPUs capped at a size, at 2048 and 4096 tokens. The base is larger than the card and
# the host, so every probe is built on meta and draws its shards block by block (plan.py's --init_device auto picks
# it). Each plan is stopped after LIMIT seconds with SIGINT (plan.json keeps what its probes measured).
# bitsandbytes' wheel is installed first. Run from the repository root:
#   bash results/h100/plan_fine_tuning_70b/run.sh OUT LIMIT CAP:N[:BLOCKS]...    e.g. 40GB:8 80GB:2:4096
# (BLOCKS: the --block_size list, 2048,4096 where not given)
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
    IFS=: read -r cap n blocks <<< "$asked"
    name="70b_qlora_${cap}_n${n}${blocks:+_L${blocks//,/_}}"
    blocks=${blocks:-2048,4096}
    mkdir -p "$out/$name"
    start=$SECONDS
    timeout -s INT "$limit" python3 plan.py --model llama-3.1-70b --world_size "$n" --gpu_memory "$cap" --sets ac \
        --variants torch_optimizer_after_fsdp --block_size "$blocks" --peft qlora \
        --output_dir "/tmp/plan_70b/$name" > "$out/$name/console.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
    gzip -c "/tmp/plan_70b/$name/plan.json" > "$out/$name/plan.json.gz" 2>/dev/null
done
