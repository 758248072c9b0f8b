#!/usr/bin/env python3
"""Plots epcomm_bench results: time vs tokens per rank, epcomm against NCCL, dispatch and combine.

    python3 bench/plot.py out.png a.json [b.json ...]

Each JSON file is one `epcomm_bench --json` run; runs with different --tokens give the points of
a curve. Curves are told apart by implementation and by shape (dispatch format, H, K, experts,
routing), so workloads of different shapes never share a line.
"""
import json
import sys
from collections import defaultdict

OPS = ("dispatch", "combine")


def load_points(paths):
    """{(op, impl, shape): {tokens: median_us}}; a later file wins for the same point."""
    points = defaultdict(dict)
    machines = set()
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        machines.add("%s x%d, %d ranks" % (run["machine"]["gpu"], run["machine"]["gpu_count"],
                                           run["n_ranks"]))
        for w in run["workloads"]:
            if not w.get("ran"):
                continue
            routing = "zipf %.2g" % w["zipf_s"] if w["zipf_s"] > 0 else "uniform"
            shape = "%s H=%d K=%d E=%d %s, %d SMs" % (w.get("format", "bf16"), w["hidden"],
                                                      w["top_k"], w["experts"], routing,
                                                      w["num_sms"])
            for r in w["results"]:
                if r["op"] in OPS:
                    points[(r["op"], r["impl"], shape)][w["tokens"]] = r["median_us"]
    return points, machines


def plot(out_path, paths):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, machines = load_points(paths)
    if not points:
        sys.exit("plot.py: no results in " + ", ".join(paths))
    fig, axes = plt.subplots(1, len(OPS), figsize=(13, 5), sharey=True)
    shapes = sorted({shape for (_, _, shape) in points})
    colors = {shape: "C%d" % i for i, shape in enumerate(shapes)}
    for ax, op in zip(axes, OPS):
        for (p_op, impl, shape), series in sorted(points.items()):
            if p_op != op:
                continue
            xs = sorted(series)
            ax.plot(xs, [series[x] for x in xs], color=colors[shape],
                    linestyle="-" if impl == "epcomm" else "--",
                    marker="o" if impl == "epcomm" else "s", label="%s, %s" % (impl, shape))
        ax.set_title(op)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("time, µs (max over ranks of the median)")
    fig.suptitle("epcomm vs NCCL send/recv baseline — " + "; ".join(sorted(machines)))
    fig.tight_layout()
    fig.savefig(out_path, dpi=130)
    print("wrote", out_path)


def main(argv):
    if len(argv) < 3 or argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    plot(argv[1], argv[2:])


if __name__ == "__main__":
    main(sys.argv)
