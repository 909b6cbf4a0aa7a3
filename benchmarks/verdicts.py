"""The straggler verdict's truth table: real gloo jobs, symmetric and with one rank delayed, on a quiet
machine and beside a CPU hog; per cell, how often the report names the right rank, a wrong rank, none.

    python benchmarks/verdicts.py [--kinds ddp,fsdp2,tp,pipeline,zero] [--worlds 2,4] [--runs 10]
                                  [--conditions quiet,hog] [--steps 30] [--shares 0.05,0.2] [--json OUT.json]

Jobs (tests/verdict_workers.py): DDP, FSDP2 (``fully_shard`` per block), tensor parallel (DTensor,
Colwise / Rowwise per block), an n-stage GPipe pipeline, a ZeRO-style sharded optimizer
(ZeroRedundancyOptimizer over DDP); 4 residual MLP blocks; 30 steps each. Cells: no delay, and one rank
(a different one from run to run) delayed before the step, inside one block's forward, or before the
optimizer, by 5% and 20% of the kind's step time (measured first in the same processes, in the same
condition). ``hog``: one more process spins on the CPU (``while True: pass``) while the jobs run. Every
run is one job in processes that run all runs of a kind in turn (a new model and log each).

Goals: the right rank in >= 95% of the delayed runs, a wrong rank never, a straggler in <= 2% of the
symmetric runs. A rank named where none was delayed counts against these unless the job's own measure
of its work agrees (``tests.verdict_workers.works_longer``: its training thread's CPU time per step, taken by the job, not by
commpatch): the table says how many such. Prints the table (markdown) and the totals; exits 1 when a goal is missed.
``--demo N``: instead, ``make demo``'s job N times beside a CPU hog (goal: its straggler named N times).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

CELLS = [(None, 0.0)] + [
    (spot, share) for spot in ("before_step", "in_forward", "before_optimizer") for share in (0.05, 0.2)
]


EVIDENCE: list = []  # (step_arrivals, steps table, waits, p2p_steps, position_arrivals) of every run, for --evidence


def named_rank(df):
    """The rank the report names as the straggler (None when it names none), and the verdict."""
    from commpatch.analysis import cross_rank, per_step, stragglers
    from commpatch.analysis.matching import _match

    cross, steps = cross_rank(df), per_step(df, by_rank=False)
    v = stragglers.of(cross, steps)
    waits = _match(df)[1][["step", "rank", "collective", "late_us", "ranks", "start_ns"]]
    EVIDENCE.append(
        (cross.step_arrivals, steps[["step", "stage", "step_us"]], waits, cross.p2p_steps, cross.position_arrivals)
    )
    return (v["rank"] if v and v["straggler"] else None), v


def run_kind(kind, n, runs, steps, timeout, cells=None):
    """All cells (or ``cells``) x ``runs`` of one kind in one set of ``n`` processes: [(cell, slow rank,
    named, verdict)]."""
    import pandas as pd

    from commpatch.data.frame import apply_schema
    from tests.multiproc import run_ranks
    from tests.verdict_workers import truth_jobs, works_longer

    jobs, meta = [], []
    for run in range(runs):
        for spot, share in cells or CELLS:
            slow = (run + CELLS.index((spot, share))) % n if spot else None
            jobs.append(dict(kind=kind, spot=spot, share=share, slow_rank=slow, steps=steps, seed=run))
            meta.append(((spot, share), slow))
    logs = run_ranks(truth_jobs, n, timeout=timeout, jobs=jobs)
    out = []
    for j, (cell, slow) in enumerate(meta):
        df = apply_schema(pd.concat([logs[r][j][0] for r in range(n)], ignore_index=True))
        named, v = named_rank(df)
        heavier = named is not None and works_longer(named, [logs[r][j][3] for r in range(n)], v["late_median_us"])
        out.append((cell, slow, named, v, logs[0][j][1], logs[0][j][2], heavier))
    return out


def demo_runs(runs: int) -> int:
    """``make demo``'s job (examples/demo.py: 2 DDP ranks, rank 1 sleeps 5 ms before each step) ``runs``
    times beside a CPU hog: how often its report names rank 1 the straggler (the JSON headline)."""
    import tempfile

    named = []
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run(
                    [sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--out", tmp],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                (run_dir,) = [os.path.join(tmp, d) for d in os.listdir(tmp)]
                report = subprocess.run(
                    [sys.executable, "-m", "commpatch", "report", run_dir, "--format", "json", "--no-progress"],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                s = json.loads(report.stdout)["headline"]["straggler"]
                named.append(s["rank"] if s["verdict"] == "straggler" else None)
                print(f"# demo beside a CPU hog: {s}", flush=True)
    finally:
        hog.kill()
        hog.wait()
    right = sum(r == 1 for r in named)
    print(f"\nthe demo beside a CPU hog: rank 1 named in {right} of {runs} runs ({named})")
    return 0 if right == runs else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default="ddp,fsdp2,tp,pipeline,zero")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--conditions", default="quiet,hog")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--shares", default="0.05,0.2", help="the delays' shares of the step to run (the symmetric cell always runs)"
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None, help="write every run's verdict here")
    parser.add_argument(
        "--evidence",
        default=None,
        help="pickle every run's verdict inputs here (step_arrivals, steps, waits, p2p_steps, position_arrivals)",
    )
    parser.add_argument("--demo", type=int, default=0, help="instead: run the demo this many times beside a CPU hog")
    args = parser.parse_args()
    if args.demo:
        return demo_runs(args.demo)
    table: dict = {}
    records = []
    started = time.time()
    for condition in args.conditions.split(","):
        hog = None
        if condition == "hog":
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for n in map(int, args.worlds.split(",")):
                for kind in args.kinds.split(","):
                    t = time.time()
                    shares = {float(s) for s in args.shares.split(",")}
                    cells = [c for c in CELLS if c[0] is None or any(abs(c[1] - s) < 1e-9 for s in shares)]
                    results = run_kind(kind, n, args.runs, args.steps, args.timeout, cells)
                    print(f"# {condition} {kind} x{n}: {len(results)} jobs in {time.time() - t:.0f} s", flush=True)
                    for cell, slow, named, v, delay_ms, step_ms, heavier in results:
                        key = (kind, n, cell[0] or "none", cell[1], condition)
                        c = table.setdefault(
                            key, dict(right=0, wrong=0, heavier=0, none=0, runs=0, delay_ms=delay_ms, step_ms=step_ms)
                        )
                        c["runs"] += 1
                        if slow is None:
                            c["wrong" if named is not None else "right"] += 1
                        else:
                            c["right" if named == slow else ("none" if named is None else "wrong")] += 1
                        c["heavier"] += named is not None and named != slow and heavier
                        records.append(
                            dict(
                                kind=kind,
                                world=n,
                                spot=cell[0],
                                share=cell[1],
                                condition=condition,
                                slow=slow,
                                named=named,
                                delay_ms=delay_ms,
                                step_ms=step_ms,
                                heavier=heavier,
                                verdict={k: (x if not isinstance(x, float) or x == x else None) for k, x in v.items()},
                            )
                        )
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    print(
        "\n| job | ranks | delay | condition | runs | right | wrong rank (of which heavier) | none named | "
        "delay (ms) / step (ms) |\n|---|---|---|---|---|---|---|---|---|"
    )
    for (kind, n, spot, share, condition), c in sorted(table.items()):
        delay = "none (symmetric)" if spot == "none" else f"{spot} {share:.0%}"
        right = f"{c['right']}" if spot != "none" else f"{c['right']} (no straggler)"
        wrong = f"{c['wrong']}" if spot != "none" else f"{c['wrong']} (a straggler named)"
        wrong += f" ({c['heavier']})" if c["heavier"] else ""
        print(
            f"| {kind} | {n} | {delay} | {condition} | {c['runs']} | {right} | {wrong} | "
            f"{c['none'] if spot != 'none' else '-'} | {c['delay_ms']:.2f} / {c['step_ms']:.1f} |"
        )
    delayed = [c for k, c in table.items() if k[2] != "none"]
    symmetric = [c for k, c in table.items() if k[2] == "none"]
    d_runs = sum(c["runs"] for c in delayed)
    s_runs = sum(c["runs"] for c in symmetric)
    right = sum(c["right"] for c in delayed)
    wrong = sum(c["wrong"] for c in delayed)
    false = sum(c["wrong"] for c in symmetric)
    # named where the job's own CPU time per step says that rank works longer (works_longer): a real straggler
    heavier_d, heavier_s = sum(c["heavier"] for c in delayed), sum(c["heavier"] for c in symmetric)
    print(
        f"\ndelayed runs: right rank {right} of {d_runs} ({right / max(d_runs, 1):.1%}), wrong rank {wrong} "
        f"(of which the job's CPU time per step says that rank works longer: {heavier_d}); symmetric runs: a "
        f"straggler named in {false} of {s_runs} ({false / max(s_runs, 1):.1%}; of which working longer by the "
        f"job's CPU time: {heavier_s}); {time.time() - started:.0f} s"
    )
    wrong, false = wrong - heavier_d, false - heavier_s
    if args.evidence:
        import pickle

        with open(args.evidence, "wb") as f:
            pickle.dump([dict(r, evidence=e) for r, e in zip(records, EVIDENCE)], f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    ok = right >= 0.95 * d_runs and wrong == 0 and false <= 0.02 * s_runs
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
