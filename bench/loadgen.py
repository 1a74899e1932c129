#!/usr/bin/env python3
"""Closed-loop streaming load generator for OpenAI-compatible servers
(`kvmesh serve`, llama.cpp's `llama-server`, ...). Python stdlib only.

    loadgen.py run --url http://127.0.0.1:8000 --label kvmesh --json out.json [options]
    loadgen.py report kvmesh.json llama-server.json [--json combined.json]

`run` synthesizes conversation-like requests from a trace of
(ContextTokens, GeneratedTokens) pairs (the Azure LLM inference 2023
conversation trace format: TIMESTAMP,ContextTokens,GeneratedTokens), scaled
by --scale and clipped to [--min-prompt, --max-prompt] x [--min-output,
--max-output], sampled with a fixed seed so that every server gets exactly the
same requests. Each prompt is a random sequence of words that are single
tokens with a leading space (taken from the GGUF vocabulary when --gguf is
given), so the prompt's token count is the sampled length and no two prompts
share a prefix; the server-reported usage.prompt_tokens is recorded too.

For each concurrency level C, C clients each send a streaming POST
/v1/completions, wait for it to finish and send the next one (closed loop),
until the level's requests are used up or its time budget is spent. EOS is
suppressed with logit_bias {"2": -100} (and ignore_eos unless --no-ignore-eos)
so every server generates exactly max_tokens tokens.

Metrics per level: TTFT (send -> first streamed text) p50/p99, ITL (gaps
between consecutive streamed text chunks) p50/p99, mean TPOT, output tokens/s
(completion tokens of all requests / level wall time), requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import struct
import sys
import time
from urllib.parse import urlsplit

# ---------------------------------------------------------------- prompt synthesis

_FALLBACK_WORDS = (
    "the of and to in is was for on that with as by at from his her they this had are but not be were "
    "which have one you all their an has been there who more when will would can out also time other into "
    "about only new some could these two may first then any like after over such made most well back years "
    "where just many city year through those before people because same world under during while state both "
    "water found called part three since long great each last house work school small right still later "
    "public order light night power line high name music group family local early game point place country"
).split()


def gguf_tokens(path: str) -> list[str]:
    """`tokenizer.ggml.tokens` of a GGUF file (stdlib reader)."""
    scal = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:

        def rd(fmt):
            fmt = "<" + fmt
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def rstr():
            return f.read(rd("Q")).decode("utf-8", "replace")

        def val(t):
            if t == 8:
                return rstr()
            if t == 9:
                et, n = rd("I"), rd("Q")
                return [val(et) for _ in range(n)]
            return rd(scal[t])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not GGUF")
        rd("I"), rd("Q")
        for _ in range(rd("Q")):
            k, t = rstr(), rd("I")
            v = val(t)
            if k == "tokenizer.ggml.tokens":
                return v
    raise ValueError(f"{path}: no tokenizer.ggml.tokens")


def single_token_words(gguf: str | None, limit: int = 3000) -> list[str]:
    """Common lowercase words that are one token with their leading space
    ('Ġword' in the byte-level BPE vocabulary, lowest ids = earliest merges)."""
    if not gguf:
        return list(_FALLBACK_WORDS)
    words = []
    for tok in gguf_tokens(gguf):
        if tok.startswith("Ġ") and 3 <= len(tok) - 1 <= 9 and tok[1:].isascii() and tok[1:].isalpha() and tok[1:].islower():
            words.append(tok[1:])
            if len(words) >= limit:
                break
    return words


def load_trace(path: str) -> list[tuple[int, int]]:
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in rows]


def synth_requests(args, level: int, n: int, words: list[str]) -> list[dict]:
    """n requests for one concurrency level; identical for every server."""
    pairs = load_trace(args.trace)
    rng = random.Random(f"{args.seed}/{level}")
    out = []
    for i in range(n):
        ctx, gen = rng.choice(pairs)
        p = min(args.max_prompt, max(args.min_prompt, round(ctx * args.scale)))
        o = min(args.max_output, max(args.min_output, round(gen * args.scale)))
        prompt = "".join(" " + rng.choice(words) for _ in range(p))
        out.append({"prompt": prompt, "prompt_tokens": p, "max_tokens": o})
    return out


# ---------------------------------------------------------------- HTTP/1.1 + SSE over asyncio streams


class HttpError(Exception):
    pass


async def _read_headers(reader):
    status_line = await reader.readline()
    if not status_line:
        raise HttpError("connection closed before the response")
    parts = status_line.decode("latin-1").split(" ", 2)
    status = int(parts[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


async def _body_pieces(reader, headers):
    """Yield the response body as it arrives (chunked, sized, or to EOF)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                return
            left -= len(data)
            yield data
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


async def post(host, port, path, payload: dict, timeout: float):
    """Non-streaming POST; returns (status, parsed JSON or text)."""
    body = json.dumps(payload).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        )
        await writer.drain()

        async def read_all():
            status, headers = await _read_headers(reader)
            data = b"".join([p async for p in _body_pieces(reader, headers)])
            return status, data

        status, data = await asyncio.wait_for(read_all(), timeout)
    finally:
        writer.close()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode("utf-8", "replace")


async def stream_completion(host, port, payload: dict, timeout: float) -> dict:
    """One streaming /v1/completions request; returns timings and counts."""
    body = json.dumps(payload).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    res = {"ttft": None, "gaps": [], "chunks": 0, "completion_tokens": None, "prompt_tokens": None,
           "finish_reason": None, "error": None, "latency": None}
    try:
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        )
        await writer.drain()

        async def consume():
            status, headers = await _read_headers(reader)
            if status != 200:
                data = b"".join([p async for p in _body_pieces(reader, headers)])
                raise HttpError(f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}")
            buf = b""
            last = None
            async for piece in _body_pieces(reader, headers):
                now = time.perf_counter()
                buf += piece.replace(b"\r\n", b"\n")
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        obj = json.loads(data)
                        if "error" in obj:
                            raise HttpError(f"stream error: {obj['error']}")
                        for ch in obj.get("choices") or []:
                            if ch.get("text"):
                                res["chunks"] += 1
                                if last is None:
                                    res["ttft"] = now - t0
                                else:
                                    res["gaps"].append(now - last)
                                last = now
                            if ch.get("finish_reason"):
                                res["finish_reason"] = ch["finish_reason"]
                        u = obj.get("usage")
                        if u:
                            res["completion_tokens"] = u.get("completion_tokens")
                            res["prompt_tokens"] = u.get("prompt_tokens")

        await asyncio.wait_for(consume(), timeout)
    except (HttpError, OSError, asyncio.TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        writer.close()
    res["latency"] = time.perf_counter() - t0
    if res["completion_tokens"] is None and res["error"] is None:
        res["completion_tokens"] = res["chunks"]  # server sent no usage: one chunk per token
    return res


# ---------------------------------------------------------------- the load


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def run_level(args, host, port, conc: int, reqs: list[dict]) -> dict:
    queue = list(reversed(reqs))
    results = []
    t0 = time.perf_counter()
    deadline = t0 + args.level_timeout

    def body(r):
        b = {"model": args.model, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0.0,
             "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {str(args.eos_id): -100}}
        if args.ignore_eos:
            b["ignore_eos"] = True
        return b

    async def client():
        while queue and time.perf_counter() < deadline:
            r = queue.pop()
            left = max(1.0, deadline - time.perf_counter() + args.request_grace)
            sent = time.perf_counter() - t0
            res = await stream_completion(host, port, body(r), timeout=left)
            res["sent_s"] = sent
            res["requested_prompt_tokens"] = r["prompt_tokens"]
            res["max_tokens"] = r["max_tokens"]
            results.append(res)

    await asyncio.gather(*(client() for _ in range(conc)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    errs = [r["error"] for r in results if r["error"] is not None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    tpot = [(r["latency"] - r["ttft"]) / (r["completion_tokens"] - 1) for r in ok
            if r["ttft"] is not None and (r["completion_tokens"] or 0) > 1]
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    ms = lambda x: None if x is None else round(x * 1000.0, 2)  # noqa: E731
    level = {
        "concurrency": conc,
        "requests": len(results),
        "requests_planned": len(reqs),
        "errors": len(errs),
        "error_samples": errs[:3],
        "truncated": len(results) < len(reqs),
        "wall_s": round(wall, 3),
        "ttft_p50_ms": ms(pct(ttft, 50)),
        "ttft_p99_ms": ms(pct(ttft, 99)),
        "itl_p50_ms": ms(pct(gaps, 50)),
        "itl_p99_ms": ms(pct(gaps, 99)),
        "tpot_mean_ms": ms(sum(tpot) / len(tpot)) if tpot else None,
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall, 2) if wall > 0 else None,
        "req_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "prompt_tokens_requested_mean": round(sum(r["requested_prompt_tokens"] for r in ok) / len(ok), 1) if ok else None,
        "prompt_tokens_reported_mean": (
            round(sum(r["prompt_tokens"] for r in ok) / len(ok), 1)
            if ok and all(r["prompt_tokens"] is not None for r in ok) else None),
        "max_tokens_mean": round(sum(r["max_tokens"] for r in ok) / len(ok), 1) if ok else None,
        "short_outputs": sum(1 for r in ok if (r["completion_tokens"] or 0) < r["max_tokens"]),
        # one row per request, in send order: [sent_s, ttft_s, latency_s, prompt_tokens, completion_tokens]
        "per_request": [
            [round(r["sent_s"], 3), None if r["ttft"] is None else round(r["ttft"], 3), round(r["latency"], 3),
             r["requested_prompt_tokens"], r["completion_tokens"]]
            for r in sorted(results, key=lambda r: r["sent_s"])],
    }
    return level


async def cmd_run(args) -> dict:
    u = urlsplit(args.url)
    host, port = u.hostname, u.port or 80
    words = single_token_words(args.gguf)
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) == 1:
        counts *= len(levels)
    if len(counts) != len(levels):
        raise SystemExit("--requests needs one count, or one per concurrency level")

    # Warm-up, and a check that prompts have the intended token count.
    probe = [{"prompt": "".join(" " + w for w in random.Random(1).choices(words, k=64)), "prompt_tokens": 64,
              "max_tokens": 4}]
    status, r = await post(host, port, "/v1/completions",
                           {"model": args.model, "prompt": probe[0]["prompt"], "max_tokens": 4, "temperature": 0.0},
                           timeout=120)
    if status != 200:
        raise SystemExit(f"{args.label}: warm-up request failed: HTTP {status}: {str(r)[:300]}")
    probe_tokens = (r.get("usage") or {}).get("prompt_tokens") if isinstance(r, dict) else None
    print(f"[loadgen] {args.label}: warm-up ok; 64-word probe prompt = {probe_tokens} tokens", file=sys.stderr)

    out = {"label": args.label, "url": args.url, "probe_prompt_tokens_for_64_words": probe_tokens, "levels": []}
    for conc, n in zip(levels, counts):
        reqs = synth_requests(args, conc, n, words)
        print(f"[loadgen] {args.label}: concurrency {conc}, {n} requests ...", file=sys.stderr)
        lv = await run_level(args, host, port, conc, reqs)
        out["levels"].append(lv)
        print(f"[loadgen] {args.label}: c={conc} done in {lv['wall_s']}s, {lv['output_tok_s']} tok/s, "
              f"{lv['errors']} errors", file=sys.stderr)
        if lv["errors"]:
            print(f"[loadgen]   errors: {lv['error_samples']}", file=sys.stderr)
    return out


# ---------------------------------------------------------------- report

COLS = [("conc", "concurrency", "{}"), ("reqs", "requests", "{}"), ("err", "errors", "{}"),
        ("TTFT p50", "ttft_p50_ms", "{:.0f}"), ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
        ("ITL p50", "itl_p50_ms", "{:.1f}"), ("ITL p99", "itl_p99_ms", "{:.1f}"),
        ("TPOT", "tpot_mean_ms", "{:.1f}"), ("out tok/s", "output_tok_s", "{:.1f}"),
        ("prompt", "prompt_tokens_reported_mean", "{}"), ("out", "max_tokens_mean", "{}"), ("wall s", "wall_s", "{:.1f}")]


def table(run: dict) -> str:
    lines = [f"== {run['label']} ({run['url']}); times in ms", "  ".join(f"{h:>9}" for h, _, _ in COLS)]
    for lv in run["levels"]:
        cells = []
        for _, k, fmt in COLS:
            v = lv.get(k)
            cells.append(f"{'-' if v is None else fmt.format(v):>9}")
        lines.append("  ".join(cells) + ("  (truncated: level time budget spent)" if lv.get("truncated") else ""))
    return "\n".join(lines)


def compare(runs: list[dict], conc: int) -> dict:
    """kvmesh / other ratios at one concurrency level."""
    def at(run):
        return next((lv for lv in run["levels"] if lv["concurrency"] == conc), None)
    a, b = at(runs[0]), at(runs[1])
    if not a or not b:
        return {}
    r = {"concurrency": conc, "numerator": runs[0]["label"], "denominator": runs[1]["label"]}
    for k in ("output_tok_s", "ttft_p99_ms", "ttft_p50_ms", "itl_p99_ms", "itl_p50_ms"):
        if a.get(k) and b.get(k):
            r[k] = round(a[k] / b[k], 3)
    return r


def cmd_report(args) -> int:
    runs = [json.load(open(p)) for p in args.files]
    for run in runs:
        print(table(run))
        print()
    combined = {"runs": runs}
    if len(runs) >= 2:
        levels = sorted({lv["concurrency"] for lv in runs[0]["levels"]})
        combined["ratios"] = [compare(runs, c) for c in levels]
        hi = max(levels)
        r = compare(runs, hi)
        num, den = runs[0]["label"], runs[1]["label"]
        print(f"ratios {num}/{den}:")
        for rr in combined["ratios"]:
            print(f"  c={rr.get('concurrency')}: out tok/s x{rr.get('output_tok_s', '-')}, "
                  f"TTFT p99 x{rr.get('ttft_p99_ms', '-')}, TTFT p50 x{rr.get('ttft_p50_ms', '-')}, "
                  f"ITL p99 x{rr.get('itl_p99_ms', '-')}")
        if r.get("output_tok_s") is not None and r.get("ttft_p99_ms") is not None:
            ok = r["output_tok_s"] >= args.target_speedup and r["ttft_p99_ms"] < 1.0
            verdict = "MET" if ok else "NOT MET"
            print(f"target at c={hi} (>= {args.target_speedup}x output tok/s and lower p99 TTFT): {verdict} "
                  f"(tok/s x{r['output_tok_s']}, p99 TTFT x{r['ttft_p99_ms']})")
            combined["target"] = {"concurrency": hi, "min_speedup": args.target_speedup, "met": ok}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(combined, f, indent=2)
    return 0


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="load one server")
    r.add_argument("--url", required=True, help="server base URL (loopback), e.g. http://127.0.0.1:8000")
    r.add_argument("--label", default="server")
    r.add_argument("--model", default="SmolLM2-135M-Instruct")
    r.add_argument("--trace", default=os.path.join(here, "..", "..", "shared", "traces", "azure_llm_conv_2023.csv"))
    r.add_argument("--gguf", help="model GGUF, for the single-token word list")
    r.add_argument("--concurrency", default="1,8,32")
    r.add_argument("--requests", default="8,24,96", help="requests per level (one, or one per level)")
    r.add_argument("--scale", type=float, default=0.25, help="multiply trace lengths by this")
    r.add_argument("--min-prompt", type=int, default=16)
    r.add_argument("--max-prompt", type=int, default=1024)
    r.add_argument("--min-output", type=int, default=4)
    r.add_argument("--max-output", type=int, default=128)
    r.add_argument("--seed", type=int, default=2023)
    r.add_argument("--eos-id", type=int, default=2)
    r.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    r.add_argument("--level-timeout", type=float, default=240.0, help="no new requests after this many s per level")
    r.add_argument("--request-grace", type=float, default=60.0, help="extra s an in-flight request may take")
    r.add_argument("--json", help="write the results here")
    p = sub.add_parser("report", help="print tables and ratios of run results (first file is the numerator)")
    p.add_argument("files", nargs="+")
    p.add_argument("--target-speedup", type=float, default=3.0)
    p.add_argument("--json", help="write the combined results here")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        out = asyncio.run(cmd_run(args))
        print(table(out))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return 0
    return cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
