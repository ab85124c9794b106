"""Record a synthetic multi-rank trace into a file ledger, optionally with faults.

    python -m tests.synthetic.demo OUT_DIR [--steps N] [--tp N] [--faults all|none|a,b]

from the checkout's root (`make demo-synthetic` runs it, then checks the ledger). Prints each
injected fault and where the ledger must find it.
"""

from __future__ import annotations

import argparse
import sys

from kvledger.producer.sinks import FileSink
from tests.synthetic.engine import FAULTS, SHARING_FAULTS, FaultSpec, GroupSpec, SimConfig, simulate

# Faults that need several ranks to be visible.
MULTI_RANK = {"rank_divergence", "rank_missing"}


def spread_faults(names: list[str], steps: int, tp_size: int) -> tuple[FaultSpec, ...]:
    spread = max(steps // (len(names) + 1), 1)
    return tuple(
        FaultSpec(name, spread * (i + 1), tp_rank=1 if name in MULTI_RANK and tp_size > 1 else 0)
        for i, name in enumerate(names)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.synthetic.demo", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="ledger directory to write (created)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--faults", default="all", help="'all', 'none' or a comma list of: " + ", ".join(FAULTS))
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    # The demo's engine has a sliding-window group: no prefix caching, so no shared blocks.
    every = [f for f in FAULTS if f not in SHARING_FAULTS]
    names = [] if args.faults == "none" else every if args.faults == "all" else args.faults.split(",")
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        parser.error(f"unknown fault(s): {', '.join(unknown)}")
    if args.tp < 2:
        names = [n for n in names if n not in MULTI_RANK]
    config = SimConfig(
        seed=args.seed,
        engine_id="demo-engine",
        steps=args.steps,
        tp_size=args.tp,
        groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 64)),
        num_blocks=160,
        max_num_seqs=12,
        max_batched_tokens=192,
        arrival_rate=0.6,
        dummy_every=50,
        faults=spread_faults(names, args.steps, args.tp),
    )
    sim = simulate(config)
    with FileSink(args.out) as sink:
        sink.write(sim.events)
    print(
        f"recorded {len(sim.events)} events of {args.tp} rank(s) into {args.out} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(sim.stats.items()))})"
    )
    for e in sim.expected:
        where = f"step {e.step}" if e.step is not None else "somewhere"
        print(
            f"  injected {e.fault}: expect {e.kind} on tp{e.tp_rank} at {where}"
            + (f" for {e.req_id}" if e.req_id else "")
        )
    for f in sim.unplaced_faults:
        print(f"  could not place fault {f.kind} (no target after step {f.step})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
