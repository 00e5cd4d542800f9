#!/usr/bin/env bash
# Nsight Compute's view of one call of the paged decode kernel's partial pass: stall reasons, memory
# workload and per-instruction (SASS) stall samples, for kernel_variants' cases at their default launch.
# The dense case reads the same bytes at 80% of copy; the paged ones at ~55%: the diff says why.
#
#   bash eval/ncu_decode.sh OUT_DIR [KIND:CONTEXT:BATCH:TABLE_AHEAD ...]
#   NCU_VARIANT_ARGS="--max-registers=0" bash eval/ncu_decode.sh OUT_DIR quant:32768:8:2   # a launch option changed
#
# The launch is the library's default (warps and register cap by storage, integer tiles in pieces, fp16 / PTX
# dequantization) unless NCU_VARIANT_ARGS repeats an option (the last value wins); the twelfth lease's code.
#
# Needs a CUDA machine with ncu (Firecracker leases; `--clock-control none` leaves the clocks alone).
# Writes OUT_DIR/ncu_decode.tar.gz (details text, stall reasons and a SASS csv per case) and prints the headline
# sections and the largest stall reasons.
set -u
out=${1:?usage: ncu_decode.sh OUT_DIR [KIND:CONTEXT:BATCH:AHEAD ...]}
shift
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(full:32768:8:1 dense:32768:8:1 quant:32768:8:2)
work=$(mktemp -d)
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 2; }
for c in "${cases[@]}"; do
    IFS=: read -r kind ctx batch ahead <<<"$c"
    name=${kind}_${ctx}_${batch}
    timeout 240 "$ncu" --clock-control none --target-processes all --kernel-name regex:_partial_kernel \
        --launch-skip 0 --launch-count 1 --set full --import-source no -f -o "$work/$name" \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 -m eval.kernel_variants --out "$work/$name.json" --cases "$kind:$ctx:$batch" --block-n 64 \
        --num-warps 0 --num-stages 2 --int-tile 1 --int-pieces 1 --half-dequant 1 --max-registers=-1 \
        --table-ahead "$ahead" --repeats 3 ${NCU_VARIANT_ARGS:-} >"$work/$name.log" 2>&1
    echo "== $c: ncu rc $?"
    "$ncu" -i "$work/$name.ncu-rep" --page details >"$work/${name}_details.txt" 2>&1
    "$ncu" -i "$work/$name.ncu-rep" --page source --print-source sass --csv >"$work/${name}_sass.csv" 2>&1
    # warp-cycles per issued instruction by stall reason, largest first (what the loop waits on)
    "$ncu" -i "$work/$name.ncu-rep" --page raw --csv --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        >"$work/${name}_stalls.csv" 2>&1
    python3 - "$work/${name}_stalls.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if any("stalled" in c for c in r)), None)
def number(c):
    try:
        return float(c.replace(",", ""))
    except ValueError:
        return None
data = [r for r in rows[head + 1:] if sum(number(c) is not None for c in r) > len(r) // 2] if head is not None else []
if data:  # the header, maybe a units row, then the kernel's row
    names, values = rows[head], data[0]
    pairs = []
    for n, v in zip(names, values):
        if "stalled_" not in n:
            continue
        try:
            pairs.append((float(v.replace(",", "")), n.split("stalled_")[-1].split("_per_issue")[0]))
        except ValueError:
            pass
    print("stalls (warp cycles per issued instruction):", ", ".join(f"{k} {v:.2f}" for v, k in sorted(pairs)[::-1][:8]))
PY
    grep -E "Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Warp Cycles Per Issued|Issued Ipc|Stall|L1/TEX Hit|L2 Hit|Block Limit|Waves Per SM|Grid Size|Block Size" \
        "$work/${name}_details.txt" | head -40
    rm -f "$work/$name.ncu-rep"
done
tar -czf "$out/ncu_decode.tar.gz" -C "$work" .
ls -la "$out"
