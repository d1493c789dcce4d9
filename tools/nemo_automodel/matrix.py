"""NeMo AutoModel's Megatron-FSDP path, every case: NeMo's DDP (the reference), stock
megatron-fsdp and flatfsdp, full runs and Checkpointer save -> resume in both directions.

    NEMO_VENV=<venv with torch==2.13.0, the project's [test] extra, nemo-automodel==0.7.0 --no-deps>
    PROJ=<flatfsdp checkout> OUT=<folder> python tools/nemo_automodel/matrix.py
    OUT=<folder> python tools/nemo_automodel/matrix.py summary      # the table again

CONFIGS (default "adamw:1 sgd:1 adamw:2"): optimizer and param groups. Each run is 2 gloo ranks
under torchrun (nemo_run.py); docs/megatron.md ("NeMo AutoModel") has the figures.
"""
import itertools
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = os.environ.get("NEMO_VENV", os.path.expanduser("~/.cache/nemo-venv")) + "/bin/torchrun"
OUT = os.environ.get("OUT", "/tmp/nemo_automodel_matrix")
PROJ = os.environ.get("PROJ", os.path.dirname(os.path.dirname(HERE)))
CONFIGS = os.environ.get("CONFIGS", "adamw:1 sgd:1 adamw:2").split()
PORTS = iter(range(29621, 29721))

def run(tag: str, **env) -> dict:
    """One torchrun of nemo_run.py; its result (losses) or the error that ended it."""
    path = f"{OUT}/{tag}.json"
    log = f"{OUT}/{tag}.log"
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{PROJ}/src", "OUT_JSON": path, **env}
    t = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(["nice", "-n", "5", TORCHRUN, "--nproc_per_node", "2", "--master_port", str(next(PORTS)),
                              f"{HERE}/nemo_run.py"], env=e, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    res = json.load(open(path)) if rc == 0 and os.path.exists(path) else {"error": tail_error(log)}
    print(f"  {tag}: rc={rc} {time.time() - t:.0f}s {res.get('losses', res.get('error'))}", flush=True)
    return res

def tail_error(log: str) -> str:
    lines = [l for l in open(log) if "Error" in l and "rank0" in l]
    return lines[-1].strip()[:300] if lines else "crashed"

def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    results = {}
    for cfg in CONFIGS:
        opt, groups = cfg.split(":")
        base = dict(OPT=opt, GROUPS=groups, STEPS="4", SAVE_AT="2")
        print(f"== {cfg}", flush=True)
        r = results[cfg] = {}
        r["ddp"] = run(f"{opt}{groups}_full_ddp", STRATEGY="ddp", PROVIDER="stock", MODE="full", **base)
        for lib in ("stock", "flatfsdp"):
            r[f"full_{lib}"] = run(f"{opt}{groups}_full_{lib}", STRATEGY="megatron_fsdp", PROVIDER=lib, MODE="full", **base)
            ck = f"{OUT}/ckpt_{opt}{groups}_{lib}"
            subprocess.call(["rm", "-rf", ck])
            r[f"save_{lib}"] = run(f"{opt}{groups}_save_{lib}", STRATEGY="megatron_fsdp", PROVIDER=lib, MODE="save", CKPT=ck, **base)
        for src, dst in itertools.product(("stock", "flatfsdp"), repeat=2):
            ck = f"{OUT}/ckpt_{opt}{groups}_{src}"
            r[f"load_{src}_{dst}"] = run(f"{opt}{groups}_load_{src}_{dst}", STRATEGY="megatron_fsdp", PROVIDER=dst, MODE="load", CKPT=ck, **base)
    json.dump(results, open(f"{OUT}/results.json", "w"), indent=1)
    summarize(results)

def diff(a: list, b: list) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))

def summarize(results: dict) -> None:
    for cfg, r in results.items():
        print(f"\n{cfg}:")
        ddp = r["ddp"].get("losses")
        for lib in ("stock", "flatfsdp"):
            full = r[f"full_{lib}"].get("losses")
            print(f"  {lib:9s} full run vs NeMo DDP: max|diff| {diff(full, ddp) if full and ddp else 'n/a'}")
        for src, dst in itertools.product(("stock", "flatfsdp"), repeat=2):
            got = r[f"load_{src}_{dst}"].get("losses")
            ref = r[f"full_{src}"].get("losses")
            want = [l[2:] for l in ref] if ref else None
            same = r[f"load_{src}_{src}"].get("losses")
            print(f"  resume {src}->{dst}: steps 3-4 vs {src}'s uninterrupted: "
                  f"{diff(got, want) if got and want else r[f'load_{src}_{dst}'].get('error')}"
                  + (f", vs {src}'s own resume: {diff(got, same) if got and same else 'n/a'}" if src != dst else ""))

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "summary":
        summarize(json.load(open(f"{OUT}/results.json")))
    else:
        main()
