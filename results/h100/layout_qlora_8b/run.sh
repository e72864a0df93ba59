#!/usr/bin/env bash
# The layout search under QLoRA (a 4-bit base, bf16 adapters, AdamW), timed: the Llama-3.1-8B shape on 8 GPUs of
# 24 GB, 4096 tokens, 16 sequences a step, each timing an emulated launch of the candidate's own layout over the
# default links; no timing starts after BUDGET seconds. Then the winner's one-GPU check exactly as plan.py printed
# it. bitsandbytes' wheel is installed first (the image has peft). Run from the repository root:
#   bash results/h100/layout_qlora_8b/run.sh OUT search BUDGET   # plan.py; writes OUT/console.txt, plan.json, ...
#   bash results/h100/layout_qlora_8b/run.sh OUT check           # the printed check, from OUT's plan.json
set -u
out=$1
mkdir -p "$out"
python3 -m pip install -q --no-deps .device_wheels/bitsandbytes*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, accelerate, transformers, peft, bitsandbytes, sys; print(torch.__version__, \
accelerate.__version__, transformers.__version__, peft.__version__, bitsandbytes.__version__, sys.version.split()[0])" \
    > "$out/versions.txt" 2>&1
start=$SECONDS
case $2 in
    search)
        rm -rf /tmp/layout_qlora_8b
        python3 plan.py --find layout --model llama-3.1-8b --world_size 8 --gpu_memory 24GB --block_size 4096 \
            --global_batch 16 --levers full,model,chunked --peft qlora --time_budget_s "$3" \
            --output_dir /tmp/layout_qlora_8b > "$out/console.txt" 2>&1
        echo "plan.py: exit $? in $((SECONDS - start)) s" | tee -a "$out/console.txt"
        cp /tmp/layout_qlora_8b/plan.json "$out/plan.json"
        cp /tmp/layout_qlora_8b/accelerate_config.json /tmp/layout_qlora_8b/layout.png "$out/" 2>/dev/null ;;
    check)
        check=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['winner']['commands']['one_gpu_check'])" \
            "$out/plan.json")
        echo "$check" > "$out/check_command.txt"
        eval "$check" > "$out/check_console.txt" 2>&1
        echo "check: exit $? in $((SECONDS - start)) s" | tee -a "$out/check_console.txt" ;;
esac
