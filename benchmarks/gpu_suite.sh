#!/usr/bin/env bash
# Every GPU measurement of attnlab in one run, written to one JSON file: issue 11's training throughput (end to
# end, full recipe, compiled; every variant against standard; --jobs 3 packing), NS-Attn's overhead rows (batch
# 128, fp32/bf16, eager/compiled) and DnA's bf16 ViT-B/16 row. Run from the repository root, nothing to install:
#
#   benchmarks/gpu_suite.sh [OUT.json]             # default: $OUT/gpu_suite.json if $OUT is set, else ./gpu_suite.json
#   benchmarks/gpu_suite.sh --dry-run [OUT.json]   # every step tiny on the CPU (or GPU_SUITE_DRY=1): checks the script
#
# Targets (one H200-class GPU): vit_cifar full recipe, batch 128, >= 30k img/s end to end; swin_cifar >= 10k img/s;
# every variant within 5% of standard compiled; 3 packed swin_cifar runs >= 2x one run; NS-Attn <= 1.05 x standard;
# DnA >= 0.85 x standard. Each step runs under `timeout`, and a total budget (GPU_SUITE_BUDGET, default 450 s) cuts
# the later steps short, so the whole suite ends in under 8 minutes; the per-step estimates are in docs/perf.md.
# No network: the end-to-end runs train on random pixels written in CIFAR-10's file layout (same shapes, same
# augmentation, so the same speed; accuracy means nothing), or on real CIFAR-10 if GPU_SUITE_CIFAR names its folder.
set -euo pipefail

DRY=${GPU_SUITE_DRY:-0}
if [[ ${1:-} == --dry-run ]]; then DRY=1; shift; fi
if [[ -n ${OUT:-} ]]; then JSON=${1:-$OUT/gpu_suite.json}; else JSON=${1:-gpu_suite.json}; fi
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PY DRY
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_suite.XXXXXX")
export WORK
trap 'rm -rf "$WORK"' EXIT
# one inductor cache for every step: a graph compiled once is not compiled again
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor}

if [[ $DRY == 1 ]]; then
    export DEV=cpu AMP=none BATCH=16 N_TRAIN=64 EPOCHS=1 COMPILE="--no-compile" PACK_MODEL=vit_cifar PACK_STEPS=1 PACK_BATCH=2 \
        TT="--steps 1 --warmup 0 --rounds 1 --batch-size 4" \
        NS="--batch-size 2 --warmup 0 --iters 1 --rounds 2" DNA="--batch-sizes 2 --warmup 0 --iters 1 --rounds 2" \
        NS_MODELS=vit_cifar DNA_MODEL=vit_cifar DNA_ATTN="standard,dna" DNA_DTYPE=fp32 NS_DTYPES=fp32 NS_COMPILE=no \
        VARIANTS="ns"
    SCALE=4  # a loaded 2-core machine: the limits below are for the GPU
    export OMP_NUM_THREADS=1  # four processes at once in packed_swin
else
    export DEV=cuda AMP=bf16 BATCH=128 N_TRAIN=50000 EPOCHS=2 COMPILE="--compile" PACK_MODEL=swin_cifar PACK_STEPS=200 PACK_BATCH=128 \
        TT="--steps 30 --warmup 5 --rounds 3 --batch-size 128" \
        NS="--batch-size 128 --warmup 10 --iters 40 --rounds 3" DNA="--batch-sizes 128 --warmup 10 --iters 50 --rounds 3" \
        NS_MODELS=vit_cifar,swin_cifar DNA_MODEL=vit_base_patch16_224 DNA_ATTN="standard,dna,dna[triton],dna[straightforward]" \
        DNA_DTYPE=bf16 NS_DTYPES=fp32,bf16 NS_COMPILE=yes \
        VARIANTS="ns,dna,sigma,speccond"
    SCALE=1
fi
BUDGET=${GPU_SUITE_BUDGET:-$((450 * SCALE))}

env_info() {
    "$PY" - <<'EOF'
import platform, torch
print(f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"# cuda:{i} {torch.cuda.get_device_name(i)}")
try:
    import triton
    print(f"# triton {triton.__version__}")
except ImportError:
    print("# triton not installed")
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
}

fake_cifar() {  # random uint8 pixels in CIFAR-10's python layout (loaded with verify_md5: false)
    if [[ -n ${GPU_SUITE_CIFAR:-} ]]; then ln -s "$(cd "$GPU_SUITE_CIFAR" && pwd)" "$WORK/cifar"; echo "# real CIFAR-10"; return; fi
    "$PY" - <<'EOF'
import os, pickle
import numpy as np
root = os.path.join(os.environ["WORK"], "cifar", "cifar-10-batches-py")
os.makedirs(root)
g = np.random.default_rng(0)
n = int(os.environ["N_TRAIN"])
def write(name, count):
    with open(os.path.join(root, name), "wb") as f:
        pickle.dump({"data": g.integers(0, 256, (count, 3072), dtype=np.uint8),
                     "labels": g.integers(0, 10, count).tolist()}, f)
for i in range(1, 6):
    write(f"data_batch_{i}", n // 5)
write("test_batch", max(n // 5, 16))
with open(os.path.join(root, "batches.meta"), "wb") as f:
    pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
print(f"# {n} random training images in CIFAR-10's layout")
EOF
}

e2e() {  # attnlab train, full ns_cifar recipe, compiled; the last epoch's img/s (the first one compiles)
    local model=$1
    "$PY" -m attnlab train --recipe ns_cifar --model "$model" --dataset cifar10 --data-dir "$WORK/cifar" \
        --data-options '{verify_md5: false}' --epochs "$EPOCHS" --batch-size "$BATCH" --device "$DEV" --amp "$AMP" \
        $COMPILE --runs-dir "$WORK/runs" --name "e2e_$model" --no-progress
    "$PY" - "$WORK/runs/e2e_$model/metrics.jsonl" "$model" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| model | epoch | img/s |\n|---|---:|---:|")
for m in lines:
    if "img_per_s" in m:
        print(f"| {sys.argv[2]} | {m['epoch']} | {m['img_per_s']:.0f} |")
EOF
}

packed() {  # training steps of PACK_MODEL: one process alone, then 3 at once on the same device (what --jobs 3
    # does); each process warms up, then all start their timed steps together (a file barrier)
    cat > "$WORK/pack.py" <<'EOF'
import os, sys, time
import torch
from attnlab.bench import input_shape, measure_train_throughput
from attnlab.models import build_model
me, n = int(sys.argv[1]), int(sys.argv[2])
work, steps, batch_size = os.environ["WORK"], int(os.environ["PACK_STEPS"]), int(os.environ["PACK_BATCH"])
dev = torch.device("cuda" if os.environ["DEV"] == "cuda" else "cpu")
amp = torch.bfloat16 if os.environ["AMP"] == "bf16" else None
torch.manual_seed(me)
model = build_model(os.environ["PACK_MODEL"], num_classes=100).to(dev)
batch = (torch.randn(batch_size, *input_shape(model), device=dev), torch.randint(0, 100, (batch_size,), device=dev))
measure_train_throughput(model, batch, steps=max(1, steps // 10), warmup=0, amp_dtype=amp)
open(f"{work}/ready_{n}_{me}", "w").close()
while sum(os.path.exists(f"{work}/ready_{n}_{i}") for i in range(n)) < n:
    time.sleep(0.005)
print(measure_train_throughput(model, batch, steps=steps, warmup=0, amp_dtype=amp))
EOF
    "$PY" "$WORK/pack.py" 0 1 > "$WORK/pack_1_0.out"
    for i in 0 1 2; do "$PY" "$WORK/pack.py" "$i" 3 > "$WORK/pack_3_$i.out" & done
    wait
    "$PY" - <<'EOF'
import os
w, model = os.environ["WORK"], os.environ["PACK_MODEL"]
one = float(open(f"{w}/pack_1_0.out").read())
three = sum(float(open(f"{w}/pack_3_{i}.out").read()) for i in range(3))
print(f"# {os.environ['PACK_STEPS']} timed steps of batch {os.environ['PACK_BATCH']} per process, started together")
print("| model | processes | img/s (sum) | ratio to one |\n|---|---:|---:|---:|")
print(f"| {model} | 1 | {one:.1f} | 1.000 |")
print(f"| {model} | 3 | {three:.1f} | {three / one:.3f} |")
EOF
}

variants() {  # each paper's variant against standard, full recipe, eager and compiled (one call per variant, so a
    # timeout keeps the rows already printed; the inductor cache makes standard's compile after the first cheap)
    local v
    for v in ${VARIANTS//,/ }; do
        if [[ $DRY != 1 ]] && grep -q -- '"--end-to-end"' benchmarks/train_throughput.py; then
            "$PY" benchmarks/train_throughput.py --end-to-end --models vit_cifar --attn "standard,$v" --device "$DEV" \
                --amp "$AMP" --batch-size "$BATCH" --steps 60 --warmup 20 --rounds 3
        else  # the dry run does not compile (minutes on a CPU): the model step alone, eager
            "$PY" benchmarks/train_throughput.py --models vit_cifar --attn "standard,$v" --device "$DEV" --amp "$AMP" $TT
        fi
    done
}
export BUDGET
export -f env_info fake_cifar e2e packed variants

START=$SECONDS
STEPS=()
run_step() {  # name limit_s command...: run under timeout, within what is left of the budget
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - (SECONDS - START)))
    STEPS+=("$name")
    printf '%s\n' "$*" > "$WORK/$name.cmd"
    if ((left < 15)); then
        echo "skipped 0 0" > "$WORK/$name.status"; : > "$WORK/$name.out"
        printf '%-16s skipped (budget of %s s spent)\n' "$name" "$BUDGET"; return
    fi
    limit=$((limit * SCALE))
    ((limit > left)) && limit=$left
    local t0=$SECONDS rc=0
    timeout -k 10 "$limit" bash -c "$*" > "$WORK/$name.out" 2>&1 || rc=$?
    echo "$rc $((SECONDS - t0)) $limit" > "$WORK/$name.status"
    printf '%-16s rc %-3s %4s s (limit %s s)\n' "$name" "$rc" "$((SECONDS - t0))" "$limit"
}

# order: what the issue's targets need first; est. H200 seconds in docs/perf.md
run_step env 20 env_info
run_step data 40 fake_cifar
run_step e2e_vit_cifar 120 e2e vit_cifar
run_step e2e_swin_cifar 150 e2e swin_cifar
run_step ns_eager 60 "\"\$PY\" benchmarks/ns_overhead.py --models \$NS_MODELS --attn standard,ns --device \$DEV --dtypes \$NS_DTYPES --compile no \$NS"
run_step dna_vit_b 75 "\"\$PY\" benchmarks/dna_overhead.py --models \$DNA_MODEL --attn \"\$DNA_ATTN\" --device \$DEV --dtype \$DNA_DTYPE \$DNA"
run_step packed_swin 60 packed
run_step variants 180 variants
run_step ns_compiled 120 "\"\$PY\" benchmarks/ns_overhead.py --models \$NS_MODELS --attn standard,ns --device \$DEV --dtypes bf16 --compile \$NS_COMPILE \$NS"

"$PY" - "$JSON" "${STEPS[@]}" <<'EOF'
import datetime, json, os, sys
work, out, steps = os.environ["WORK"], sys.argv[1], sys.argv[2:]

def tables(text):
    """Markdown tables of a step's output as lists of row dicts (cells as numbers where they are)."""
    found, rows, header = [], None, None
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header, rows = cells, []
            elif not all(set(c) <= set("-: ") for c in cells):
                vals = []
                for c in cells:
                    try:
                        vals.append(float(c))
                    except ValueError:
                        vals.append(c)
                rows.append(dict(zip(header, vals)))
        elif header is not None:
            found.append(rows)
            header = rows = None
    return found

result = {"dry_run": os.environ["DRY"] == "1", "date": datetime.datetime.now().isoformat(timespec="seconds"),
          "budget_s": int(os.environ["BUDGET"]), "steps": {}}
for name in steps:
    rc, seconds, limit = open(f"{work}/{name}.status").read().split()
    text = open(f"{work}/{name}.out", errors="replace").read()
    result["steps"][name] = {"command": open(f"{work}/{name}.cmd").read().strip(),
                             "rc": None if rc == "skipped" else int(rc), "skipped": rc == "skipped",
                             "timed_out": rc in ("124", "137"), "seconds": int(seconds), "limit_s": int(limit),
                             "notes": [l for l in text.splitlines() if l.startswith("#")],
                             "tables": tables(text), "tail": text[-2000:]}

def rows(step):
    return [r for t in result["steps"].get(step, {}).get("tables", []) for r in t]

def last_rate(step):
    r = rows(step)
    return r[-1]["img/s"] if r else None

def ratios(step, key_prefix):
    return [v for r in rows(step) for k, v in r.items() if k.startswith(key_prefix) and isinstance(v, float)]

checks = {}
def check(name, value, target, ok):
    checks[name] = {"value": value, "target": target, "met": None if value is None else ok(value)}
check("vit_cifar end-to-end img/s", last_rate("e2e_vit_cifar"), ">= 30000", lambda v: v >= 30000)
check("swin_cifar end-to-end img/s", last_rate("e2e_swin_cifar"), ">= 10000", lambda v: v >= 10000)
r = ratios("variants", "compiled ratio") or ratios("variants", "ratio")
check("every variant / standard, training", min(r) if r else None, ">= 0.95", lambda v: v >= 0.95)
p = [x for x in ratios("packed_swin", "ratio") if x != 1.0]
check("3 packed swin_cifar / one", p[0] if p else None, ">= 2", lambda v: v >= 2)
n = ratios("ns_eager", "ns / ") + ratios("ns_compiled", "ns / ")
check("NS-Attn time / standard, worst row", max(n) if n else None, "<= 1.05", lambda v: v <= 1.05)
for spec in ("dna", "dna[triton]"):
    d = [r["throughput vs standard"] for r in rows("dna_vit_b") if r.get("attention") == spec]
    check(f"{spec} bf16 ViT-B/16 throughput / standard", d[0] if d else None, ">= 0.85", lambda v: v >= 0.85)
result["targets"] = checks
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
with open(out, "w") as f:
    json.dump(result, f, indent=1)
print(f"\n{'step':<16} {'rc':>4} {'s':>5}")
for name, s in result["steps"].items():
    print(f"{name:<16} {'skip' if s['skipped'] else s['rc']:>4} {s['seconds']:>5}")
for name, c in checks.items():
    print(f"{name}: {c['value']} (target {c['target']}; met: {c['met']})")
print(f"wrote {out}" + (" (dry run: the numbers mean nothing)" if result["dry_run"] else ""))
sys.exit(0 if all(s["rc"] == 0 for s in result["steps"].values()) else 1)
EOF
