#!/usr/bin/python3
"""plot.py — PNG plots of the benchmarks' tables (matplotlib, Debian python3-matplotlib).

    bench/plot.py serve   TABLE [--section TEXT] -o OUT.png   throughput and TPOT vs concurrency
    bench/plot.py loadgen TABLE [--section TEXT] -o OUT.png   tokens/s and TTFT vs concurrency
    bench/plot.py kl      TABLE [--section TEXT] -o OUT.png   KL per KV configuration

TABLE is what the benchmark already writes: the JSON of bench/serve_gpu.sh (serve_gpu.json) or
of `bdfp4 eval-kl --json`, or a markdown file holding the table (bench/RESULTS.md, serve_gpu.md,
the table `make bench-serve`'s loadgen appends). In a markdown file the table is the first one
under the last heading that contains TEXT (default: the last table of the file).

serve: one line per KV configuration and context (synthetic prefill; a real-prefill context is
marked "real"), decode tokens/s per GPU (left) and TPOT (right, the table's p50 or steady value)
against the concurrency, log-2 axis. loadgen: tokens/s and TTFT p50 against the concurrency. kl:
KL ×10⁻³ per configuration with its standard error, log axis (bf16 is 0 and drawn as such).
"""
import argparse
import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


# ---- reading the tables ---------------------------------------------------------------------

def md_tables(path, section):
    """The rows (dicts by header) of the first table under the last heading containing section
    (None: the last table of the file), and that heading."""
    lines = open(path, encoding="utf-8").read().splitlines()
    start, heading = 0, ""
    if section:
        hits = [i for i, l in enumerate(lines) if l.startswith("#") and section in l]
        if not hits:
            sys.exit("plot.py: no heading with '%s' in %s" % (section, path))
        start, heading = hits[-1], lines[hits[-1]].lstrip("# ")
    tables, cur = [], []
    for i in range(start, len(lines)):
        l = lines[i].strip()
        if section and i > start and l.startswith("## "):
            break
        if l.startswith("|"):
            cur.append([c.strip() for c in l.strip("|").split("|")])
        elif cur:
            tables.append(cur)
            cur = []
    if cur:
        tables.append(cur)
    tables = [t for t in tables if len(t) > 2]
    if not tables:
        sys.exit("plot.py: no table in %s%s" % (path, " under '%s'" % section if section else ""))
    t = tables[0] if section else tables[-1]
    head = t[0]
    return [dict(zip(head, r)) for r in t[2:]], heading


def number(s):
    """The first number of a cell ("7.45 ms", "1.38×", "4/4", "929 †"), None for "–" or "-"."""
    m = re.search(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", str(s))
    return float(m.group(0)) if m else None


def col(row, *names):
    """The value of the first column whose header contains one of names (case-insensitive)."""
    for n in names:
        for k, v in row.items():
            if n.lower() in k.lower():
                return v
    return None


def load(path, section):
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            return json.load(f), path
    rows, heading = md_tables(path, section)
    return rows, heading or path


# ---- the plots ------------------------------------------------------------------------------

def serve_points(rows):
    """{(kv, context label): [(concurrency, decode tok/s, TPOT ms)]} from serve_gpu.json rows
    or a serving markdown table."""
    series = {}
    for r in rows:
        if "conc" in r:  # serve_gpu.json
            kv, ctx, conc = r["kv"], int(r["ctx"]), int(r["conc"])
            real = r.get("mode") == "real"
            tps = r.get("dec_tok_s_gpu")
            tpot = r.get("steady_tpot_ms") if r.get("steady_ok") == 1 else r.get("tpot_p50_ms")
        else:
            kv = col(r, "KV")
            ctxs = col(r, "context")
            conc = number(col(r, "conc"))
            real = "real" in (ctxs or "") or (col(r, "prefill") or "").startswith("real")
            ctx = int(number(ctxs)) if number(ctxs) is not None else 0
            tps = number(col(r, "decode tok/s"))
            tpot = number(col(r, "steady TPOT", "TPOT p50", "TPOT mean"))
        if kv is None or conc is None or tps is None:
            continue
        label = "%s, %dK%s" % (kv, ctx // 1024, " real prefill" if real else "")
        series.setdefault(label, []).append((int(conc), float(tps),
                                             float(tpot) if tpot is not None else None))
    return series


def plot_serve(rows, title, out):
    series = serve_points(rows)
    if not series:
        sys.exit("plot.py: no serving rows (KV, concurrency, decode tok/s) in the table")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for label, pts in sorted(series.items()):
        pts.sort()
        style = "--" if label.startswith("bf16") else "-"
        a.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
        tp = [p for p in pts if p[2] is not None]
        b.plot([p[0] for p in tp], [p[2] for p in tp], style, marker="o", label=label)
    for ax, what in ((a, "decode tokens/s per GPU"), (b, "TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    a.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def plot_loadgen(rows, title, out):
    pts = []
    for r in rows:
        c, tps = number(col(r, "concurrency")), number(col(r, "tokens/s"))
        ttft = number(col(r, "TTFT p50", "TTFT mean"))
        if c is not None and tps is not None:
            pts.append((int(c), tps, ttft))
    if not pts:
        sys.exit("plot.py: no loadgen rows (concurrency, tokens/s) in the table")
    pts.sort()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
    b.plot([p[0] for p in pts if p[2] is not None], [p[2] for p in pts if p[2] is not None],
           marker="o")
    for ax, what in ((a, "tokens/s"), (b, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def plot_kl(rows, title, out):
    names, kl, se = [], [], []
    for r in rows:
        name = r.get("config", col(r, "config"))
        v = r.get("kl_e3", number(col(r, "KL")))
        e = r.get("kl_se_e3", number(col(r, "s.e.")))
        if name is None or v is None:
            continue
        names.append(name)
        kl.append(float(v))
        se.append(float(e) if e is not None else 0.0)
    if not names:
        sys.exit("plot.py: no KL rows (config, KL) in the table")
    fig, ax = plt.subplots(figsize=(8, 4), dpi=80)
    colors = ["#2c7fb8" if n.startswith("bitdecoding") else "#999999" for n in names]
    ax.bar(range(len(names)), [max(v, 1e-2) for v in kl], yerr=se, color=colors, capsize=3)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("KL ×1e-3 nats (± s.e.; bf16 = 0)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=("serve", "loadgen", "kl"))
    ap.add_argument("table", help="serve_gpu.json, eval-kl JSON, or a markdown file")
    ap.add_argument("--section", help="markdown: the last heading that contains this")
    ap.add_argument("--title", help="the plot's title (default: the heading or the file)")
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    a = ap.parse_args()
    rows, heading = load(a.table, a.section)
    title = a.title or heading
    {"serve": plot_serve, "loadgen": plot_loadgen, "kl": plot_kl}[a.kind](rows, title, a.out)
    print("plot.py: %s" % a.out)


if __name__ == "__main__":
    main()
