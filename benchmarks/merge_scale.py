"""Cross-rank report at scale: the full `commpatch report` on N ranks x M rows, as a real run writes them.

    python benchmarks/merge_scale.py                              # 64 ranks x 100,000 rows
    python benchmarks/merge_scale.py --sizes 64,256,1024          # the table of issue 14 (~7 GB of logs at 1024)
    python benchmarks/merge_scale.py --sizes 8 --rows 10000 --engine pandas
    python benchmarks/merge_scale.py --dir /tmp/logs --keep       # reuse / keep the generated logs

For each size, one binary rank log per rank (`rank{r}.cplog`) is generated as `record.log` writes
it (commpatch.testing.write_binary_run: a tensor-parallel group of 8, a data-parallel group of
world/8, the world group, a send/recv pair per step, a straggler rank and a planted size
mismatch); generation is not measured. Then `commpatch report DIR --format json` runs as a
subprocess: its wall time and the peak RSS of its whole process tree (sampled every 50 ms from
/proc: the report's reading processes count) are measured, and the report must name the
straggler first and the planted mismatch. The logs of a size are deleted before the next size
(unless --keep). The load average is printed with each line: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTES_PER_ROW = 61 * 2.5  # the binary log, plus the engine's staged copy and its spill room


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants now."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, stack, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while stack:
        p = stack.pop()
        stack += children.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total


def measure(cmd, env) -> tuple[float, int, str, str, float]:
    """(wall s, peak tree RSS bytes, stdout, stderr, CPU s of the tree) of ``cmd``."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)
        wall = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return wall, peak, out.read().decode(), err.read().decode(), cpu


def check(report: dict, straggler: int, mismatch_rank: int) -> tuple[bool, bool]:
    """(the straggler is the first rank of the ranks table, the planted mismatch is reported)."""
    ranks = report["sections"].get("ranks") or [{}]
    found_straggler = ranks[0].get("rank") == straggler
    found_mismatch = any(
        m["kind"] == "bytes" and f"on rank(s) {mismatch_rank}" in m["detail"]
        for m in report["sections"].get("mismatches") or []
    )
    return found_straggler, found_mismatch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64", help="comma-separated rank counts (default 64)")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per rank (rounded to whole steps)")
    parser.add_argument("--engine", default="auto", choices=("auto", "pandas", "duckdb"))
    parser.add_argument("--dir", help="where the logs go (a subdirectory per size; reused when present)")
    parser.add_argument("--keep", action="store_true", help="keep generated logs")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from commpatch.testing import write_binary_run

    sizes = [int(s) for s in args.sizes.split(",")]
    base = args.dir or tempfile.mkdtemp(prefix="commpatch_merge_scale_")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )
    results = []
    try:
        for ranks in sizes:
            directory = os.path.join(base, f"ranks{ranks}")
            straggler, mismatch = 3 % ranks, (5 % ranks, 7)
            generated = not (os.path.isdir(directory) and os.listdir(directory))
            if generated:
                need = ranks * args.rows * BYTES_PER_ROW
                free = shutil.disk_usage(base).free
                if free < need:
                    print(
                        f"merge_scale: {ranks} ranks x {args.rows} rows needs ~{need / 1e9:.1f} GB on {base}, "
                        f"{free / 1e9:.1f} GB free: skipped",
                        file=sys.stderr,
                    )
                    continue
                t = time.perf_counter()
                write_binary_run(directory, ranks, args.rows, straggler=straggler, mismatch=mismatch)
                size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
                print(
                    f"generated {ranks} binary rank logs x {args.rows} rows ({size / 1e9:.2f} GB) "
                    f"in {time.perf_counter() - t:.0f} s (not measured)",
                    file=sys.stderr,
                    flush=True,
                )
            load = os.getloadavg()[0]
            wall, peak, out, err, cpu = measure(
                [
                    sys.executable,
                    "-m",
                    "commpatch",
                    "report",
                    directory,
                    "--format",
                    "json",
                    "--engine",
                    args.engine,
                    "--no-progress",
                ],
                env,
            )
            try:
                report = json.loads(out)
            except ValueError:
                print(f"merge_scale: the report failed at {ranks} ranks:\n{err[-2000:]}", file=sys.stderr)
                return 1
            rows = int(report["title"].split(": ", 1)[1].split()[0])
            found = check(report, straggler, mismatch[0])
            results.append((ranks, rows, wall, peak, found, (load, os.getloadavg()[0]), cpu))
            print(
                f"merge_scale: {ranks} ranks, {rows:,} rows: {wall:.1f} s ({cpu:.0f} CPU s), peak RSS {peak / 2**30:.2f} GiB, "
                f"straggler found: {found[0]}, mismatch found: {found[1]} (load {load:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after)",
                flush=True,
            )
            if generated and not args.keep:
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(
        "\n| ranks | rows | report (s) | s per M rows | CPU (s, all processes) | peak RSS (GiB) | straggler | mismatch "
        "| load (1 min) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---|---|")
    for ranks, rows, wall, peak, found, load, cpu in results:
        print(
            f"| {ranks} | {rows:,} | {wall:.1f} | {wall / rows * 1e6:.2f} | {cpu:.0f} | {peak / 2**30:.2f} | "
            f"{'found' if found[0] else 'MISSED'} | {'found' if found[1] else 'MISSED'} | {load[0]:.1f}-{load[1]:.1f} |"
        )
    return 0 if all(all(r[4]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
