"""What memory the machine has not used recently costs: a diagnostic for the join and
first-step figures of bench/join.py (not a benchmark of unbroken).

    python bench/fresh_memory.py                 # 6 GB once, ~1 min here
    python bench/fresh_memory.py --mb 2048 --rounds 3 --idle 10

Each round allocates ``--mb`` MB, writes every page and frees it ("first touch"), then does
the same again at once ("again": pages the kernel just had back). On bare metal both cost
about a microsecond a 4 KB page. In a VM whose guest reports free pages to its host
(``page_reporting`` on the kernel command line, printed below), memory beyond what the VM
used recently has gone back to the host, and its first touch pays the host's allocation too.
This machine (2026-12-04): 12 GB first touched at 23.6 us a page (166 MB/s) against 5.1 us
again; 2 GB it had just used, 2.2 against 1.9 us. A node that starts while the others keep
their memory (``UNBROKEN_MALLOC=kept``) takes its pages from that cold part: the likely
reason why a third node started twice as slowly beside two such trainers.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch

from common import ProgressLine, fmt, median, print_command, print_table, ratio, write_results


def touch(mb: int) -> tuple[float, int]:
    """Seconds and page faults to allocate ``mb`` MB and write each page once."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    block = torch.empty(mb << 20, dtype=torch.uint8)
    block.fill_(1)
    seconds = time.perf_counter() - start
    del block
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=6144, help="megabytes touched per allocation")
    p.add_argument("--rounds", type=int, default=1, help="rounds (medians are reported)")
    p.add_argument("--idle", type=float, default=0.0, help="seconds idle before each round's first touch")
    args = p.parse_args()
    print_command()
    cmdline = Path("/proc/cmdline").read_text() if Path("/proc/cmdline").exists() else ""
    reporting = [w for w in cmdline.split() if w.startswith("page_reporting")]
    print("free page reporting:", " ".join(reporting) or "not on the kernel command line")
    torch.set_num_threads(1)
    first: list[tuple[float, int]] = []
    again: list[tuple[float, int]] = []
    progress = ProgressLine(args.rounds * 2)
    for r in range(args.rounds):
        progress.update(f"round {r + 1}: {args.idle:g} s idle")
        time.sleep(args.idle)
        first.append(touch(args.mb))
        progress.update(f"round {r + 1}: first touch {first[-1][0]:.2f} s", advance=1)
        again.append(touch(args.mb))
        progress.update(f"round {r + 1}: again {again[-1][0]:.2f} s", advance=1)
    progress.close()

    def per_page_us(runs: list[tuple[float, int]]) -> float | None:
        return median(s / f * 1e6 for s, f in runs if f)

    def rate(runs: list[tuple[float, int]]) -> float | None:
        return median(args.mb / s for s, _ in runs)

    s_first, s_again = median(s for s, _ in first), median(s for s, _ in again)
    print_table(
        f"{args.mb} MB allocated and written, after {args.idle:g} s idle, medians of {args.rounds}",
        ["", "first touch", "again at once (baseline)", "first / again"],
        [
            ["seconds", fmt(s_first, " s"), fmt(s_again, " s"), ratio(s_first, s_again)],
            [
                "per 4 KB page",
                fmt(per_page_us(first), " us", 1),
                fmt(per_page_us(again), " us", 1),
                ratio(per_page_us(first), per_page_us(again)),
            ],
            ["MB/s", fmt(rate(first), "", 0), fmt(rate(again), "", 0), ""],
            ["per-round first touch, s", " ".join(f"{s:.2f}" for s, _ in first), "", ""],
        ],
    )


if __name__ == "__main__":
    main()
    write_results()
