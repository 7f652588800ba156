#!/usr/bin/env bash
# The checks issues 50 and 51 ask of a lent GPU, prepared as one run: a lease is 15 minutes all told.
#
#     bash tests/benchmarks/gpu_wheels.sh                 # here, once: what the GPU machine lacks
#     # then on the device machine (the repository's root), carrying .whl, with timeout_s 600:
#     bash tests/benchmarks/gpu_checks.sh                 # about 6 minutes on an H100
#     bash tests/benchmarks/gpu_checks.sh converge        # `shoal bench converge --scale gpu`: 8 more
#
# Steps (arguments choose; default: all but converge), each under its own time limit, its output in
# $OUT/STEP.log (./gpu-checks without $OUT) and one line of it in $OUT/summary.txt:
#   tests     tests/unit/test_cuda.py and the host-sync, launch and finite checks on the GPU
#   step      the DeMo step against forward+backward: base at batch 64, small at 16 (4% target)
#   fit       estimated against measured memory, bf16, activation checkpointing as the fit chooses
#   outer     the cost of --outer-state cpu per DiLoCo round
#   export    one `shoal join` peer on the GPU (bf16 where it has it, activation checkpointing on, one
#             rank) for 3 rounds, then `shoal export`, and transformers generates from the export
#   converge  the GPU scale of the convergence benchmark (a 27M GPT, bf16)
# DEVICE=cpu runs the same steps on a CPU (a dry run of this script; outer and converge need CUDA).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-checks}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests step fit outer export)
python3 -c "import torch, shoal.peer; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$out/summary.txt"

run() {  # run STEP LIMIT_S COMMAND...: its log, and its status and last line in the summary
    local step=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$step.log" 2>&1
    local rc=$?
    echo "$step rc=$rc $((SECONDS - start))s: $(tail -n 1 "$out/$step.log" | cut -c1-400)" | tee -a "$out/summary.txt"
}

for step in "${steps[@]}"; do
    case $step in
    tests)
        run tests 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_cuda.py \
            tests/unit/test_host_syncs.py tests/unit/test_non_finite.py ;;
    step)
        run step-base 120 python3 -m tests.benchmarks.demo_step_overhead --device "$device" --model base \
            --batch 64 --repeat 20
        run step-small 60 python3 -m tests.benchmarks.demo_step_overhead --device "$device" --model small \
            --batch 16 --repeat 20 ;;
    fit)
        run fit 150 python3 -m tests.benchmarks.fit_memory --device "$device" --precision bf16 \
            --models small,base,gpt2,llama,qwen2 ;;
    outer)
        run outer 90 python3 -m tests.benchmarks.outer_state --model base --inner-steps 10 --rounds 5 ;;
    export)
        rm -rf /tmp/gpu-ckpt /tmp/gpu-export
        run join 120 python3 -m shoal.peer.cli join --device "$device" --model small --run gpu-check \
            --round-seconds 5 --max-rounds 3 --checkpoint-dir /tmp/gpu-ckpt --log-format json \
            --activation-checkpointing on --nproc-per-node 1
        run export 60 python3 -m shoal.peer.cli export --checkpoint-dir /tmp/gpu-ckpt /tmp/gpu-export
        run generate 60 python3 -c "
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained('/tmp/gpu-export').to('$device')
tokens = torch.tensor([list(b'def main(')], device='$device')
print('generated', bytes(model.generate(tokens, max_new_tokens=16, do_sample=False)[0].tolist()))" ;;
    converge)
        run converge 540 python3 -m shoal.peer.cli bench converge --scale gpu --record "$out/converge-gpu.jsonl" ;;
    *)
        echo "unknown step $step (tests, step, fit, outer, export, converge)" >&2
        exit 2 ;;
    esac
done
