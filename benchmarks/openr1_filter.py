"""Rows per second of the OpenR1 math-verify filter at several `data.num_proc`, in one invocation.

The rows follow OpenR1-Math-220k's schema (problem, answer, generations), built from reasoning-gym's
GSM-style problems: per problem one generation with the right boxed answer after the worked solution and
one with a wrong one, so math-verify parses and compares two generations per row as on the real set
(whose generations are longer: expect fewer rows/s there).

    python benchmarks/openr1_filter.py [--rows 400] [--procs 1 2]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    import datasets

    from data.sources import gsm_symbolic, verified_generations

    datasets.disable_caching()  # every run filters for real
    rows = []
    for row in gsm_symbolic(args.rows, seed=0):
        answer = row["answer"]
        right = f"{row['completion']}\n\nSo the answer is $\\boxed{{{answer}}}$."
        wrong = f"{row['completion']}\n\nSo the answer is $\\boxed{{{answer}1}}$."
        rows.append({"problem": row["prompt"], "answer": answer, "generations": [right, wrong]})
    ds = datasets.Dataset.from_list(rows)
    results = {}
    for procs in args.procs:
        start = time.perf_counter()
        kept = verified_generations(ds, num_proc=procs)
        seconds = time.perf_counter() - start
        results[procs] = (len(kept), args.rows / seconds)
        print(f"num_proc={procs}: {args.rows} rows in {seconds:.1f} s, {args.rows / seconds:.1f} rows/s, "
              f"{len(kept)} generations kept")
    base = results[args.procs[0]][1]
    for procs, (kept, rate) in results.items():
        print(f"num_proc={procs}: {rate / base:.2f}x the rows/s of num_proc={args.procs[0]}")
    if len({kept for kept, _ in results.values()}) != 1:
        raise SystemExit("the filter kept different rows at different num_proc")


if __name__ == "__main__":
    main()
