#!/usr/bin/env python3
"""Compare llama.cpp and kvmesh engine benchmark results (stdlib only).

Used by bench/engine_vs_llamacpp.sh. Inputs are the raw outputs of:
  --llama-bench FILE   `llama-bench ... -o json`             (pp512 / tg128)
  --batched FILE       `llama-batched-bench ... --output-format jsonl`
                       (the markdown table of older versions is parsed too)
  --kvmesh FILE        `kvmesh bench engine --json ...` (one JSON object;
                       omitted / empty => llama.cpp-only report)

Prints a table (default) or one JSON object (--json).  With --check the exit
status is 1 when a target is missed (or a kvmesh metric is missing), 3 when
all targets are met but the machine was busy (1-minute load average above
half the CPU count before a phase), so the result is not trustworthy.
"""

import argparse
import json
import math
import os
import re
import sys

# (metric key, label, target ratio kvmesh/llama.cpp or None)
TARGETS = {
    "prefill": 1.5,
    "decode_b1": 1.0,
    "decode_b32": 2.0,
}


def _read(path):
    if not path:
        return ""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _json_objects(text):
    """Yield every top-level JSON value that can be decoded from text.

    Tolerates log lines mixed in (llama.cpp logs to the same streams)."""
    dec = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n:
        j = min([k for k in (text.find("{", i), text.find("[", i)) if k >= 0], default=-1)
        if j < 0:
            return
        try:
            obj, end = dec.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        yield obj
        i = end


def parse_llama_bench(text):
    """Return {"pp": {n_prompt: tok_s}, "tg": {n_gen: tok_s}, "build": str}."""
    out = {"pp": {}, "tg": {}, "pp_sd": {}, "tg_sd": {}, "build": None, "cpu": None}
    for obj in _json_objects(text):
        rows = obj if isinstance(obj, list) else [obj]
        for r in rows:
            if not isinstance(r, dict) or "avg_ts" not in r:
                continue
            n_prompt, n_gen = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
            sd = _num(r.get("stddev_ts"))
            if n_prompt > 0 and n_gen == 0:
                out["pp"][n_prompt] = float(r["avg_ts"])
                out["pp_sd"][n_prompt] = sd
            elif n_gen > 0 and n_prompt == 0:
                out["tg"][n_gen] = float(r["avg_ts"])
                out["tg_sd"][n_gen] = sd
            out["build"] = out["build"] or r.get("build_commit")
            out["cpu"] = out["cpu"] or r.get("cpu_info")
    return out


_MD_ROW = re.compile(
    r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
    r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*$"
)


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def parse_batched(text):
    """Return {npl: {"pp","tg","s_pp","s_tg","runs","s_tg_runs"}} from jsonl
    (or the md table of older versions).  When the bench was run several
    times (rows repeated), S_PP / S_TG are the medians over the runs."""
    rows = []
    for obj in _json_objects(text):
        if isinstance(obj, dict) and "speed_tg" in obj and "pl" in obj:
            rows.append((int(obj["pl"]), int(obj["pp"]), int(obj["tg"]),
                         float(obj["speed_pp"]), float(obj["speed_tg"])))
    if not rows:
        for line in text.splitlines():
            m = _MD_ROW.match(line.strip())
            if m:
                rows.append((int(m.group(3)), int(m.group(1)), int(m.group(2)),
                             float(m.group(6)), float(m.group(8))))
    by_pl = {}
    for pl, pp, tg, s_pp, s_tg in rows:
        by_pl.setdefault(pl, []).append((pp, tg, s_pp, s_tg))
    out = {}
    for pl, rs in by_pl.items():
        out[pl] = {
            "pp": rs[0][0],
            "tg": rs[0][1],
            "s_pp": _median([r[2] for r in rs]),
            "s_tg": _median([r[3] for r in rs]),
            "runs": len(rs),
            "s_tg_runs": [r[3] for r in rs],
        }
    return out


def parse_kvmesh(text):
    """Return the last JSON object printed that looks like a bench result."""
    found = None
    for obj in _json_objects(text):
        if isinstance(obj, dict) and ("prefill_tok_s" in obj or "decode" in obj):
            found = obj
    return found


def _num(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def build_report(lb, bb, km, meta):
    pp_n = meta.get("pp", 512)
    tg_n = meta.get("tg", 128)
    llama = {
        "pp%d_tok_s" % pp_n: lb["pp"].get(pp_n),
        "pp%d_stddev" % pp_n: lb["pp_sd"].get(pp_n),
        "tg%d_tok_s" % tg_n: lb["tg"].get(tg_n),
        "tg%d_stddev" % tg_n: lb["tg_sd"].get(tg_n),
        "batched": {str(k): v for k, v in sorted(bb.items())},
        "version": meta.get("llamacpp_version") or lb.get("build"),
        "cpu_info": lb.get("cpu"),
    }
    km_decode = {}
    if km:
        for d in km.get("decode") or []:
            if isinstance(d, dict) and "batch" in d:
                km_decode[int(d["batch"])] = _num(d.get("tok_s"))

    metrics = []

    def add(key, label, lv, kv, target):
        lv, kv = _num(lv), _num(kv)
        ratio = kv / lv if (lv and kv is not None) else None
        ok = None
        if target is not None:
            ok = (ratio is not None and ratio >= target)
        metrics.append({
            "metric": key, "label": label, "llamacpp": lv, "kvmesh": kv,
            "ratio": ratio, "target": target, "pass": ok,
        })

    add("prefill", "prefill pp%d tok/s" % pp_n, lb["pp"].get(pp_n),
        km.get("prefill_tok_s") if km else None, TARGETS["prefill"])
    batches = sorted(set(bb) | set(km_decode)) or [1, 8, 32]
    for b in batches:
        key = "decode_b%d" % b
        add(key, "decode b%d S_TG tok/s" % b, (bb.get(b) or {}).get("s_tg"),
            km_decode.get(b), TARGETS.get(key))
    # informational: llama-bench tg128 (empty context) vs kvmesh decode b1
    add("tg%d_vs_decode_b1" % tg_n, "tg%d (llama-bench) vs b1" % tg_n,
        lb["tg"].get(tg_n), km_decode.get(1), None)

    warnings = []
    if km:
        if km.get("threads") is not None and int(km["threads"]) != meta.get("threads"):
            warnings.append("kvmesh ran with threads=%s, llama.cpp with %s" % (km["threads"], meta.get("threads")))
        if km.get("prefill_tokens") is not None and int(km["prefill_tokens"]) != pp_n:
            warnings.append("kvmesh prefill_tokens=%s, llama-bench pp=%d" % (km["prefill_tokens"], pp_n))
    for m in metrics:
        if m["llamacpp"] is None:
            warnings.append("missing llama.cpp value for %s" % m["metric"])
        if km and m["kvmesh"] is None and m["target"] is not None:
            warnings.append("missing kvmesh value for %s" % m["metric"])

    reliable = True
    for name, load in (meta.get("loads") or {}).items():
        if load is not None and meta.get("ncpu") and load > 0.5 * meta["ncpu"]:
            reliable = False
            warnings.append("load average %.2f before %s on %d CPUs: other processes skew the numbers"
                            % (load, name, meta["ncpu"]))

    targeted = [m for m in metrics if m["target"] is not None]
    all_met = bool(km) and all(m["pass"] for m in targeted)
    return {
        "model": meta.get("model"),
        "threads": meta.get("threads"),
        "load_before": meta.get("loads") or {},
        "llamacpp": llama,
        "kvmesh": km,
        "metrics": metrics,
        "all_targets_met": all_met if km else None,
        "reliable": reliable,
        "warnings": warnings,
    }


def _fmt(v, nd=2):
    return "-" if v is None else ("%.*f" % (nd, v))


def print_table(rep, out=sys.stdout):
    print("model:   %s" % rep["model"], file=out)
    print("threads: %s   llama.cpp: %s" % (rep["threads"], rep["llamacpp"].get("version") or "?"), file=out)
    hdr = ("metric", "llama.cpp", "kvmesh", "ratio", "target", "status")
    rows = []
    for m in rep["metrics"]:
        status = "-" if m["pass"] is None else ("PASS" if m["pass"] else "FAIL")
        if m["target"] is not None and m["kvmesh"] is None:
            status = "n/a"
        rows.append((
            m["label"], _fmt(m["llamacpp"]), _fmt(m["kvmesh"]),
            "-" if m["ratio"] is None else "%.2fx" % m["ratio"],
            "-" if m["target"] is None else ">=%.1fx" % m["target"],
            status,
        ))
    w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    line = "  ".join("%-*s" % (w[0], hdr[0]) if i == 0 else "%*s" % (w[i], hdr[i]) for i in range(len(hdr)))
    print(line, file=out)
    print("-" * len(line), file=out)
    for r in rows:
        print("  ".join("%-*s" % (w[0], r[0]) if i == 0 else "%*s" % (w[i], r[i]) for i in range(len(r))), file=out)
    if rep["all_targets_met"] is not None:
        print("all targets met: %s" % ("yes" if rep["all_targets_met"] else "no"), file=out)
    else:
        print("kvmesh: not run (llama.cpp only)", file=out)
    for w_ in rep["warnings"]:
        print("warning: %s" % w_, file=out)
    if not rep["reliable"]:
        print("UNRELIABLE: the machine was busy; llama.cpp's spinning threads degrade far more than"
              " kvmesh under contention, so ratios are inflated. Rerun on an idle machine"
              " (--wait-idle SECS).", file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--batched", required=True)
    ap.add_argument("--kvmesh", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--llamacpp-version", default="")
    ap.add_argument("--load", action="append", default=[], metavar="PHASE=LOADAVG",
                    help="1-minute load average seen before a phase (repeatable)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)

    lb = parse_llama_bench(_read(a.llama_bench))
    bb = parse_batched(_read(a.batched))
    km_text = _read(a.kvmesh)
    km = parse_kvmesh(km_text) if km_text.strip() else None
    if a.kvmesh and km_text.strip() and km is None:
        print("error: could not find a JSON result in kvmesh output:\n%s" % km_text[-2000:], file=sys.stderr)
        return 2
    if not lb["pp"] and not lb["tg"] and not bb:
        print("error: no llama.cpp results parsed", file=sys.stderr)
        return 2

    loads = {}
    for item in a.load:
        name, _, val = item.partition("=")
        loads[name] = _num(val)
    ncpu = os.cpu_count() or 1
    rep = build_report(lb, bb, km, {"model": a.model, "threads": a.threads, "pp": a.pp, "tg": a.tg,
                                    "llamacpp_version": a.llamacpp_version, "loads": loads, "ncpu": ncpu})
    if a.json:
        json.dump(rep, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_table(rep)
    if a.check and rep["all_targets_met"] is not True:
        return 1
    if a.check and not rep["reliable"]:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
