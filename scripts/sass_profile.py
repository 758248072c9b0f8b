#!/usr/bin/env python3
"""Where a kernel's warps spend their instructions and stalls, by function and CUDA source line.

Reads the SASS source page that scripts/device_profile_source.sh takes with Nsight Compute (one
row per instruction: address, executed count, stall samples by reason) and maps each row to its
function and source line through `nvdisasm -g` on the cubin of the same build
(scripts/device_profile_source.sh leaves the build's cubins in cubins.tar.gz; nvdisasm ships in
the nvidia-cuda-nvdisasm wheel). The page's first address is the kernel's entry; out-of-line
device functions follow the kernel in its section, and are reported by name.

  scripts/sass_profile.py ncu_source_sass.csv.gz --cubin dispatch.sm_90a.cubin \\
      --kernel 'dispatch_kernelILb1ELNS_11TokenFormatE0ELb0ELb1ELb0E' --warps 2112

--kernel is a regular expression on the mangled name (the page's first row names the kernel in
its demangled form). --warps divides executed counts into per-warp figures (blocks x warps a
block). Prints the totals (SASS instructions, warp instructions executed, 128-byte code lines
executed: the code a launch fetches), a table by function, and the --top source lines by
instructions executed.
"""
import argparse
import collections
import csv
import gzip
import re
import subprocess
import sys


def read_page(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    # Row 0 names the kernel; row 1 is the header.
    header = rows[1]
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    out = []
    for r in rows[2:]:
        if not r or not r[0].startswith("0x"):
            continue
        out.append({
            "addr": int(r[0], 16),
            "exec": int(r[col["Instructions Executed"]] or 0),
            "stalls": {s: int(r[col[s]] or 0) for s in stalls},
        })
    return out


def short_name(mangled):
    """The last identifier of a mangled nested name (_ZN 6epcomm 6detail 7ll_send I...: ll_send),
    or the name itself where it is not one."""
    if not mangled.startswith("_ZN"):
        return mangled
    i, last = 3, mangled
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while j < len(mangled) and mangled[j].isdigit():
            j += 1
        n = int(mangled[i:j])
        last, i = mangled[j:j + n], j + n
    return last


def read_disassembly(nvdisasm, cubin, kernel_re):
    """offset -> (function, file, line) over the section of the kernel matching kernel_re."""
    text = subprocess.run([nvdisasm, "-g", "-c", cubin], check=True, capture_output=True,
                          text=True).stdout
    sections = re.split(r"^\.text\.", text, flags=re.M)
    hits = [sec for sec in sections[1:] if re.search(kernel_re, sec.split(":", 1)[0])]
    if len(hits) != 1:
        names = [sec.split(":", 1)[0] for sec in hits]
        sys.exit(f"--kernel matches {len(hits)} sections of {cubin}: {names[:5]}")
    where = {}
    func, loc = "kernel", ("?", 0)
    for line in hits[0].splitlines():
        m = re.match(r"\s*\.type\s+(\S+),@function", line)
        if m:  # the kernel, then each out-of-line function placed after it
            func = short_name(m.group(1).split("$")[-1] or m.group(1))
            continue
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:
            loc = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+\S", line)
        if m:
            where[int(m.group(1), 16)] = (func, loc[0], loc[1])
    return where


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("page", help="ncu source page CSV (.csv or .csv.gz)")
    ap.add_argument("--cubin", required=True)
    ap.add_argument("--kernel", required=True, help="regex on the kernel's mangled name")
    ap.add_argument("--nvdisasm", default="nvdisasm")
    ap.add_argument("--warps", type=int, default=0, help="warps of the launch (per-warp figures)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--strip", default="", help="path prefix to drop from file names")
    a = ap.parse_args()

    rows = read_page(a.page)
    where = read_disassembly(a.nvdisasm, a.cubin, a.kernel)
    base = rows[0]["addr"]
    if len(where) != len(rows):
        sys.exit(f"the page has {len(rows)} instructions and the cubin's kernel {len(where)}: "
                 "not the same build")
    per_warp = (lambda n: f"{n / a.warps:9.1f}") if a.warps else (lambda n: "")
    by_func = collections.defaultdict(collections.Counter)
    by_line = collections.defaultdict(collections.Counter)
    lines_touched = collections.defaultdict(set)
    total = collections.Counter()
    for r in rows:
        off = r["addr"] - base
        func, path, line = where[off]
        path = path[len(a.strip):] if a.strip and path.startswith(a.strip) else path
        samples = sum(r["stalls"].values())
        for c in (by_func[func], by_line[(path, line)], total):
            c["static"] += 1
            c["exec"] += r["exec"]
            c["samples"] += samples
            for s, v in r["stalls"].items():
                c[s] += v
        if r["exec"]:
            lines_touched[func].add(off // 128)
            lines_touched["*"].add(off // 128)

    main_stalls = [s for s, _ in sorted(((s, total[s]) for s in rows[0]["stalls"]),
                                        key=lambda x: -x[1])[:5]]
    print(f"SASS instructions {total['static']}, warp instructions executed {total['exec']}"
          f"{' (' + per_warp(total['exec']).strip() + ' a warp)' if a.warps else ''}, "
          f"128-byte code lines executed {len(lines_touched['*'])}, stall samples "
          f"{total['samples']}: " + ", ".join(f"{s[6:]} {total[s]}" for s in main_stalls))
    head = " ".join(f"{s[6:]:>9}" for s in main_stalls)
    print(f"\n{'function':32} {'static':>7} {'lines':>6} {'executed':>10} "
          f"{'a warp' if a.warps else '':>9} {'samples':>8} {head}")
    for func, c in sorted(by_func.items(), key=lambda kv: -kv[1]["exec"]):
        print(f"{func[:32]:32} {c['static']:7} {len(lines_touched[func]):6} {c['exec']:10} "
              f"{per_warp(c['exec']):>9} {c['samples']:8} "
              + " ".join(f"{c[s]:9}" for s in main_stalls))
    print(f"\n{'source line':56} {'static':>7} {'executed':>10} {'a warp' if a.warps else '':>9} "
          f"{'samples':>8} {head}")
    for (path, line), c in sorted(by_line.items(), key=lambda kv: -kv[1]["exec"])[:a.top]:
        name = f"{path}:{line}"
        print(f"{name[-56:]:56} {c['static']:7} {c['exec']:10} {per_warp(c['exec']):>9} "
              f"{c['samples']:8} " + " ".join(f"{c[s]:9}" for s in main_stalls))


if __name__ == "__main__":
    main()
