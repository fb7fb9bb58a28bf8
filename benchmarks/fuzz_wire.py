"""Fuzz ``shared.wire.decode`` at volume and report case counts, outcomes and any escaped exception.

    .venv/bin/python benchmarks/fuzz_wire.py [--hypothesis 2000] [--random 100000] [--seed 0] [--json out.json]

Runs the generators of ``tests/test_wire_fuzz.py`` (valid rollouts, encoded, then mutated field by
field; see that file) two ways:

- ``--hypothesis N``: N hypothesis examples (about 13 ms each on a busy 2-core VM: hypothesis
  records every draw), from seed ``--seed``;
- ``--random N``: N cases drawn by a seeded ``random.Random`` from the same generators (about
  0.35 ms each).

Unlike the tests, an exception other than ``WireError`` is counted (by class and message) and the
run goes on, so one run lists everything that escapes. Exit status 1 if anything escaped. Timing
excludes imports.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import test_wire_fuzz as fuzz  # noqa: E402  (needs ROOT on sys.path)


def run_hypothesis(examples: int, seed_: int, escapes: Counter) -> Counter:
    """`examples` hypothesis examples of mutated messages; counts outcomes, records escapes."""
    counts: Counter = Counter()

    @seed(seed_)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data):
        chooser = fuzz.HypothesisChooser(data)
        frames, names = fuzz.mutate_message(fuzz.make_frames(chooser), chooser)
        limit = data.draw(st.sampled_from([None, 1 << 10, 0]))
        try:
            counts[fuzz.outcome(frames, limit)] += 1
        except Exception as e:   # recorded, not raised: hypothesis would stop at the first and shrink it
            escapes[f"{type(e).__name__}: {str(e)[:70]}"] += 1
            counts["escaped"] += 1

    one()
    return counts


def _report(title: str, counts: Counter, seconds: float) -> dict:
    cases = sum(counts.values()) - counts["roundtrip"]
    print(f"\n{title}: {cases:,} mutated cases against decode in {seconds:.1f} s "
          f"({cases / max(seconds, 1e-9):,.0f}/s); {counts['roundtrip']:,} fresh messages round-tripped")
    for name, n in counts.most_common():
        if name != "roundtrip":
            print(f"  {n:>9,}  {name}")
    return {"cases": cases, "roundtrips": counts["roundtrip"], "seconds": round(seconds, 2),
            "outcomes": dict(counts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hypothesis", type=int, default=2000, help="hypothesis examples (0: skip)")
    p.add_argument("--random", type=int, default=100_000, help="seeded random cases (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the counts here")
    args = p.parse_args(argv)
    escapes: Counter = Counter()
    result: dict = {"seed": args.seed}
    if args.hypothesis:
        t0 = time.perf_counter()
        counts = run_hypothesis(args.hypothesis, args.seed, escapes)
        result["hypothesis"] = _report("hypothesis", counts, time.perf_counter() - t0)
    if args.random:
        t0 = time.perf_counter()
        counts = fuzz.run_random(args.random, args.seed, escapes=escapes)
        result["random"] = _report("seeded random", counts, time.perf_counter() - t0)
    result["escaped"] = dict(escapes)
    print(f"\nexceptions other than WireError: {sum(escapes.values())}")
    for name, n in escapes.most_common():
        print(f"  {n:>9,}  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if escapes else 0


if __name__ == "__main__":
    sys.exit(main())
