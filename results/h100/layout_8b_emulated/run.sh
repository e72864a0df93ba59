#!/usr/bin/env bash
# The layout search for the Llama-3.1-8B shape (results/h200/long_context_8b/model), ranked by emulated steps: N = 64
# GPUs of 80 GB, sequences of 8192, 1024 sequences a step, every lever that runs here (float8 with torchao's wheel
# installed first). Each timing is an emulated launch of the candidate's own layout over the default links and a
# compute-only launch beside it; no timing starts after 330 s (one device call is 600 s). Then, in a second call,
# the winner's one-GPU check exactly as plan.py printed it. Run from the repository root:
#   bash results/h100/layout_8b_emulated/run.sh OUT search     # plan.py; writes OUT/console.txt, plan.json.gz, ...
#   bash results/h100/layout_8b_emulated/run.sh OUT check      # the printed check, from OUT's plan.json
set -u
out=$1
mkdir -p "$out"
python3 -m pip install -q --no-deps .device_wheels/torchao-0.18.0-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, accelerate, transformers, torchao, sys; print(torch.__version__, accelerate.__version__, \
transformers.__version__, torchao.__version__, sys.version.split()[0])" > "$out/versions.txt"
start=$SECONDS
case $2 in
    search)
        rm -rf /tmp/layout_8b
        python3 plan.py --find layout --model results/h200/long_context_8b/model --world_size 64 --gpu_memory 80GB \
            --block_size 8192 --global_batch 1024 --time_budget_s 330 --output_dir /tmp/layout_8b \
            > "$out/console.txt" 2>&1
        echo "plan.py: exit $? in $((SECONDS - start)) s" | tee -a "$out/console.txt"
        python3 visualize.py --dir /tmp/layout_8b >> "$out/console.txt" 2>&1
        cp /tmp/layout_8b/plan.json "$out/plan.json"
        cp /tmp/layout_8b/accelerate_config.json /tmp/layout_8b/layout.png "$out/" 2>/dev/null ;;
    check)
        check=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['winner']['commands']['one_gpu_check'])" \
            "$out/plan.json")
        echo "$check" > "$out/check_command.txt"
        eval "$check" > "$out/check_console.txt" 2>&1
        echo "check: exit $? in $((SECONDS - start)) s" | tee -a "$out/check_console.txt" ;;
esac
