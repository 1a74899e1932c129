#!/usr/bin/env python3
"""The Compose cluster, tested with real Docker (deploy/test.sh builds the images first).

Brings deploy/compose.yaml up with the monitoring profile under its own project name and
host ports, then checks: completions through the router (streamed and not, the same text),
mutual TLS on every node, scaling decode to 3 (the router routes to the new node within
5 s of it serving) and back to 2 (the removed node drains its streams, which end with the
fault-free text), `docker kill` of a decode node mid-stream (the stream ends with the
fault-free text), Prometheus (every target up; every PromQL expression of the dashboards
and alert rules returns data), the Dockerfile image (fetches the model into its volume at
first start, serves, reports healthy), and `down -v` leaving nothing behind.
Standard library only. Prints the figures it measures.
"""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = "kvmesh-ci"
API_PORT = int(os.environ.get("KVMESH_TEST_PORT", "18000"))
PROM_PORT = int(os.environ.get("KVMESH_TEST_PROMETHEUS_PORT", "19090"))
ETCD_PORT = int(os.environ.get("KVMESH_TEST_ETCD_PORT", "12379"))
KVMESH = os.path.join(os.path.dirname(HERE), "target", "release", "kvmesh")
API = f"http://127.0.0.1:{API_PORT}"
PROM = f"http://127.0.0.1:{PROM_PORT}"
ENV = dict(os.environ, KVMESH_PORT=str(API_PORT), KVMESH_PROMETHEUS_PORT=str(PROM_PORT),
           KVMESH_ETCD_PORT=str(ETCD_PORT))
LONG = 800  # tokens of the streams that must outlive a scale-down or a kill (400 left a
# scale-down too little: a stream could end while compose was still stopping its node); they
# ignore the end-of-sequence token, so that where greedy decoding stops cannot shorten them


def log(msg):
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(*cmd, check=True, env=ENV):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr}{out.stdout}")
    return out.stdout


def compose(*args, check=True):
    return run("docker-compose", "-p", PROJECT, "-f", f"{HERE}/compose.yaml",
               "--profile", "monitoring", *args, check=check)


def wait_for(what, cond, within, every=0.25):
    deadline = time.monotonic() + within
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        time.sleep(every)


# --- containers ------------------------------------------------------------------------

# Container name -> id, as last listed: a replica removed and started again under the same
# name is another container, with another address.
IDS = {}


def containers(service):
    """The service's running containers, by name, sorted (one `docker ps`: it lists what
    runs at one instant, while Compose may be removing a replica)."""
    out = run("docker", "ps", "--filter", f"label=com.docker.compose.project={PROJECT}",
              "--filter", f"label=com.docker.compose.service={service}",
              "--format", "{{.ID}} {{.Names}}")
    names = []
    for line in out.splitlines():
        i, name = line.split()
        IDS[name] = i
        names.append(name)
    return sorted(names)


def inspect(name, fmt):
    return run("docker", "inspect", "-f", fmt, name, check=False).strip()


def health(name):
    return inspect(name, "{{if .State.Health}}{{.State.Health.Status}}{{end}}")


IPS = {}


def ip(name):
    """The container's address (remembered per container; a restart forgets it)."""
    key = IDS.get(name, name)
    if key not in IPS:
        IPS[key] = inspect(name, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
    return IPS[key]


def node_metrics(name):
    """A node's /metrics, as {series: value} (empty if it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{ip(name)}:9100/metrics", timeout=3) as r:
            text = r.read().decode()
    except (OSError, urllib.error.URLError):
        return {}
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            series[key] = float(value)
    return series


def metric(series, name, **labels):
    """Sum of the series of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in series.items():
        if key == name or key.startswith(name + "{"):
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
    return total


def node_ready(name):
    """Whether the node's own /health says it serves its role."""
    try:
        with urllib.request.urlopen(f"http://{ip(name)}:9100/health", timeout=3) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def decode_served(name):
    return metric(node_metrics(name), "kvmesh_worker_queue_time_seconds_count", role="decode")


def decode_running(name):
    return metric(node_metrics(name), "kvmesh_worker_requests_running", role="decode")


# --- the API ---------------------------------------------------------------------------

def post(path, body, timeout=120):
    req = urllib.request.Request(API + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def completion(prompt, max_tokens, **more):
    """A greedy completion request's body; a LONG one ignores end-of-sequence."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": max_tokens >= LONG, **more}


def complete(prompt, max_tokens):
    with post("/v1/completions", completion(prompt, max_tokens)) as r:
        return json.loads(r.read())["choices"][0]["text"]


class Stream(threading.Thread):
    """A streamed completion read in the background: its text, tokens so far, error."""

    def __init__(self, prompt, max_tokens):
        super().__init__(daemon=True)
        self.prompt, self.max_tokens = prompt, max_tokens
        self.text, self.chunks, self.error, self.finish = "", 0, None, None
        self.first = threading.Event()
        self.start()

    def run(self):
        body = completion(self.prompt, self.max_tokens, stream=True)
        try:
            with post("/v1/completions", body, timeout=300) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                        break
                    choice = event["choices"][0]
                    self.text += choice.get("text") or ""
                    self.finish = choice.get("finish_reason") or self.finish
                    self.chunks += 1
                    self.first.set()
        except Exception as e:  # noqa: BLE001 - reported by the check below
            self.error = repr(e)
        self.first.set()

    def result(self):
        self.join(300)
        assert not self.is_alive(), f"stream {self.prompt!r} did not end"
        assert self.error is None, f"stream {self.prompt!r} failed: {self.error}"
        return self.text


WORDS = ("river mountain window copper garden lantern harbor meadow violin pepper "
         "canyon orchard thunder pillow marble candle falcon basket ribbon glacier").split()


def prompt(i):
    """Distinct prompts (no shared prefix beyond the first word): requests spread by load."""
    w = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(6)]
    return f"Story {i}: the {w[0]} and the {w[1]} met a {w[2]} near the {w[3]}. Then"


# --- the checks ------------------------------------------------------------------------

def bring_up():
    compose("down", "-v", "--remove-orphans", check=False)
    t0 = time.monotonic()
    compose("up", "-d")

    def answered():
        try:
            return complete("The capital of France is", 8)
        except (OSError, urllib.error.URLError):
            return None
    text = wait_for("the first answer", answered, 180, every=0.2)
    first_answer = time.monotonic() - t0
    log(f"`docker-compose up` to the first answer: {first_answer:.1f} s ({text!r})")
    for service in ("router", "prefill", "decode", "planner"):
        for name in containers(service):
            wait_for(f"{name} healthy", lambda n=name: health(n) == "healthy", 120)
    return first_answer


def check_completions():
    p = "The three primary colours are"
    plain = complete(p, 24)
    streamed = Stream(p, 24).result()
    assert plain == streamed and plain, (plain, streamed)
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
            "temperature": 0}
    with post("/v1/chat/completions", body) as r:
        chat = json.loads(r.read())["choices"][0]["message"]["content"]
    assert chat, "empty chat answer"
    for service in ("router", "prefill", "decode"):
        for name in containers(service):
            out = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
            assert "mutual TLS between nodes" in out.stdout + out.stderr, \
                f"{name} does not speak mutual TLS"
    log(f"completions: streamed == not streamed ({plain!r}); chat ok; mutual TLS on every node")


def until_served(name, within):
    """Short requests, a few at a time, until one lands on decode node `name`: how long."""
    t0, i = time.monotonic(), 0
    while decode_served(name) == 0:
        assert time.monotonic() - t0 < within, f"no request reached {name} within {within} s"
        for s in [Stream(prompt(1000 + i + k), 4) for k in range(3)]:
            s.result()
        i += 3
    return time.monotonic() - t0


def check_scale_up():
    before = set(containers("decode"))
    compose("up", "-d", "--no-recreate", "--scale", "decode=3", "--scale", "prefill=2")
    (new,) = set(containers("decode")) - before
    wait_for(f"{new} serving", lambda: node_ready(new), 120, every=0.05)
    took = until_served(new, 5)
    log(f"scaled decode to 3: {new} served a request {took:.2f} s after it began serving")
    return new, took


def check_scale_down(expected_texts):
    """Streams on every decode node; scaling to 2 drains the removed one while it runs some."""
    names = containers("decode")
    leaving = names[-1]  # compose removes the highest-numbered replica
    streams, i = [], 0
    while decode_running(leaving) == 0 or not all(decode_running(n) > 0 for n in names):
        assert i < 24, "streams did not spread over the decode nodes"
        streams.append(Stream(prompt(i), LONG))
        streams[-1].first.wait(60)
        i += 1
    running = decode_running(leaving)
    logs = subprocess.Popen(["docker", "logs", "-f", leaving], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    compose("up", "-d", "--no-recreate", "--scale", "decode=2", "--scale", "prefill=2")
    took = time.monotonic() - t0
    assert leaving not in containers("decode"), f"{leaving} is still there"
    for s in streams:
        text = s.result()
        assert text == expected_texts(s.prompt), f"stream {s.prompt!r} changed: {text!r}"
    out = logs.communicate(timeout=60)[0]
    drained = [ln for ln in out.splitlines() if "drained; stopping" in ln]
    assert drained and "finished=true" in drained[-1], \
        f"{leaving} did not drain before stopping:\n{out[-3000:]}"
    seconds = float(re.search(r"seconds=([0-9.]+)", drained[-1]).group(1))
    assert seconds > 0.05, f"{leaving} had nothing left to drain: {drained[-1]}"
    log(f"scaled decode to 2 in {took:.1f} s: {leaving} drained {running:.0f} running streams "
        f"in {seconds:.2f} s; all {len(streams)} streams intact")


def router_migrations():
    with urllib.request.urlopen(f"{API}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(re.search(r"^kvmesh_router_migrations_total (\S+)$", text, re.M).group(1))


def check_kill(expected_texts):
    p = prompt(500)
    want = expected_texts(p)
    migrations = router_migrations()
    s = Stream(p, LONG)
    wait_for("the stream's first tokens", lambda: s.chunks >= 4, 60, every=0.01)
    victim = wait_for("the stream's decode node",
                      lambda: next((n for n in containers("decode") if decode_running(n) > 0),
                                   None), 30, every=0.01)
    run("docker", "kill", victim)
    seen = s.chunks
    text = s.result()
    assert seen < s.chunks, f"the stream had ended ({seen} chunks) before the kill"
    assert text == want, f"killed mid-stream: {text!r} != {want!r}"
    moved = router_migrations() - migrations
    assert moved >= 1, "the router migrated nothing"
    log(f"docker kill {victim} at chunk {seen} of {s.chunks}: the stream moved ({moved:.0f} "
        "migration) and ended with the fault-free text")
    IPS.pop(IDS.get(victim, victim), None)
    compose("up", "-d", "--no-recreate", "--scale", "decode=2", "--scale", "prefill=2")
    wait_for(f"{victim} back", lambda: health(victim) == "healthy", 120)


def prom(query):
    url = f"{PROM}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as r:
        reply = json.loads(r.read())
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def top_level_split(expr, ops):
    """Splits `expr` at operators outside parentheses/brackets/braces/strings."""
    parts, depth, start, i, quote = [], 0, 0, 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            for op in ops:
                if expr.startswith(op, i):
                    parts.append(expr[start:i])
                    start = i + len(op)
                    i = start - 1
                    break
        i += 1
    parts.append(expr[start:])
    return [p.strip() for p in parts]


def alert_signals(expr):
    """An alert's expression without its thresholds: what must return data."""
    signals = []
    for side in top_level_split(" ".join(expr.split()), [" and ", " or ", " unless "]):
        while side.startswith("(") and side.endswith(")"):
            side = side[1:-1].strip()
        signals.append(top_level_split(side, [" > ", " < ", " >= ", " <= ", " == "])[0])
    return signals


def promql_expressions():
    with open(f"{HERE}/grafana/dashboards/kvmesh.json") as f:
        dash = json.load(f)
    exprs = [(f"panel {p['title']!r}", t["expr"].replace("$__rate_interval", "1m"))
             for p in dash["panels"] for t in p.get("targets", [])]
    rules = open(f"{HERE}/prometheus/alerts.yaml").read()
    # The rules file's exprs are YAML block scalars: take each `expr:` and its indented body.
    for m in re.finditer(r"- alert: (\w+)\n\s+expr: (\|\n((?:\s{10}.*\n)+)|(.*)\n)", rules):
        expr = m.group(3) or m.group(4)
        for signal in alert_signals(expr):
            exprs.append((f"alert {m.group(1)}", signal))
    return exprs


def check_prometheus():
    names = {t: containers(t) for t in ("router", "prefill", "decode", "planner")}
    want = sum(len(v) for v in names.values())

    def all_up():
        up = prom("up")
        return len(up) == want and all(r["value"][1] == "1" for r in up)
    wait_for(f"{want} Prometheus targets up", all_up, 90, every=1)
    # Load, so that rates and quantiles have samples in their windows.
    streams = [Stream(prompt(2000 + i), 24) for i in range(12)]
    for s in streams:
        s.result()
    exprs = promql_expressions()
    assert len(exprs) > 30, f"found only {len(exprs)} expressions"
    missing = []
    for what, expr in exprs:
        # Up to 90 s: a subquery stepped every 30 s (the alerts' `deriv(...[10m:30s])`) has
        # its two points only once the series has spanned two 30 s boundaries.
        try:
            wait_for(f"{what}: {expr}", lambda e=expr: prom(e), 90, every=1)
        except AssertionError:
            missing.append(f"{what}: {expr}")
    names_used = sorted(set(re.findall(r"\bkvmesh_[a-z0-9_]+", " ".join(e for _, e in exprs))))
    for name in names_used:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        if not prom(f'count({{__name__=~"{base}(_bucket|_count|_sum)?"}})'):
            missing.append(f"metric {name}")
    assert not missing, "PromQL with no data:\n  " + "\n  ".join(missing)
    log(f"Prometheus: {want} targets up; {len(exprs)} dashboard and alert expressions and "
        f"{len(names_used)} metric names return data")


# The load policy at an idle cluster: every node under its down thresholds, so each role
# goes to its minimum.
PLANNER_CONFIG = """
policy = "load"
[prefill]
min = 1
max = 2
[decode]
min = {decode_min}
max = 3
[cooldown]
up = "0s"
down = "0s"
down_stable_for = "4s"
[load]
interval = "2s"
"""


def run_planner(tmp, decode_min, until, within):
    """`kvmesh planner --actuator compose` on this host until `until()`; its log."""
    config = os.path.join(tmp, f"planner-{decode_min}.toml")
    with open(config, "w") as f:
        f.write(PLANNER_CONFIG.format(decode_min=decode_min))
    log_path = os.path.join(tmp, f"planner-{decode_min}.log")
    with open(log_path, "w") as out:
        planner = subprocess.Popen(
            [KVMESH, "planner", "--etcd", f"http://127.0.0.1:{ETCD_PORT}",
             "--router", API, "--config", config, "--observe-every", "1s",
             "--actuator", "compose", "--compose-file", f"{HERE}/compose.yaml",
             "--compose-project", PROJECT],
            stdout=out, stderr=subprocess.STDOUT, env=ENV)
        try:
            wait_for("the planner's scaling", until, within, every=0.5)
        finally:
            planner.terminate()
            planner.wait(30)
    return open(log_path).read()


def check_planner_scales_compose():
    """The planner's compose actuator: down to the minimum at idle (drains), then up."""
    compose("stop", "planner")  # the advisory planner resigns its lease
    nodes = containers("prefill") + containers("decode")
    follow = {n: subprocess.Popen(["docker", "logs", "-f", n], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for n in nodes}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        down = run_planner(tmp, 1, lambda: len(containers("prefill")) == 1
                           and len(containers("decode")) == 1, 120)
        took_down = time.monotonic() - t0
        for reason in ("kv_usage_low", "prefill_queue_low"):
            assert reason in down, f"no {reason} decision:\n{down[-3000:]}"
        gone = set(nodes) - set(containers("prefill") + containers("decode"))
        assert len(gone) == 2, gone
        for name in gone:
            out = follow[name].communicate(timeout=60)[0]
            assert "drained; stopping" in out and "finished=true" in out, \
                f"{name} was removed without a drain:\n{out[-2000:]}"
        for p in follow.values():
            p.kill()
        t0 = time.monotonic()
        before = set(containers("decode"))
        up = run_planner(tmp, 2, lambda: len(containers("decode")) == 2
                         and all(health(n) == "healthy" for n in containers("decode")), 120)
        took_up = time.monotonic() - t0
        assert "below_minimum" in up, up[-3000:]
        (new,) = set(containers("decode")) - before
        until_served(new, 30)
    log(f"planner, compose actuator: idle cluster down to 1+1 in {took_down:.1f} s (both "
        f"removals drained), decode back to 2 in {took_up:.1f} s ({new} serving)")


def check_dockerfile_image():
    """deploy/Dockerfile's image: the model is fetched into its volume at first start."""
    name, volume = f"{PROJECT}-image", f"{PROJECT}-image-cache"
    run("docker", "rm", "-f", name, check=False)
    run("docker", "volume", "rm", "-f", volume, check=False)
    user = inspect("kvmesh:dockerfile", "{{.Config.User}}")
    assert user and user != "root", f"the image runs as {user!r}"
    assert inspect("kvmesh:dockerfile", "{{.Config.Healthcheck}}"), "no HEALTHCHECK"
    # The host's CA bundle and pip settings, so pip inside reaches the package index as
    # the host does (a proxy's CA, say).
    ca = "/etc/ssl/certs/ca-certificates.crt"
    t0 = time.monotonic()
    run("docker", "run", "-d", "--name", name, "-p", "127.0.0.1::8000",
        "-v", f"{volume}:/var/lib/kvmesh/cache", "-v", f"{ca}:{ca}:ro",
        "-e", f"PIP_CERT={ca}", "-e", "KVMESH_HEALTH_URL=http://127.0.0.1:8000/health",
        "-e", "KVMESH_THREADS=1", "kvmesh:dockerfile", "serve", "--listen", "0.0.0.0:8000")
    try:
        wait_for(f"{name} healthy", lambda: health(name) in ("healthy", "unhealthy"), 300, 1)
        assert health(name) == "healthy", run("docker", "logs", name, check=False)
        port = run("docker", "port", name, "8000/tcp").split(":")[-1].strip()
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        took = time.monotonic() - t0
        files = run("docker", "run", "--rm", "-v", f"{volume}:/c", "--entrypoint", "ls",
                    "kvmesh:dockerfile", "/c/kvmesh/models")
        assert "SmolLM2-135M-Instruct.Q4_1.gguf" in files, files
        log(f"Dockerfile image: user {user}, model fetched into its volume, healthy and "
            f"answering in {took:.1f} s ({text!r})")
    finally:
        run("docker", "rm", "-f", name, check=False)
        run("docker", "volume", "rm", "-f", volume, check=False)


def check_down():
    compose("down", "-v", "--remove-orphans")
    label = f"label=com.docker.compose.project={PROJECT}"
    left = {
        "containers": run("docker", "ps", "-aq", "--filter", label).split(),
        "networks": run("docker", "network", "ls", "-q", "--filter", label).split(),
        "volumes": run("docker", "volume", "ls", "-q", "--filter", label).split(),
    }
    assert not any(left.values()), f"left behind by down -v: {left}"
    log("down -v: no container, network or volume left")


def main():
    t0 = time.monotonic()
    texts = {}

    def expected(p):
        # The fault-free text: the same prompt, greedy, not streamed, on the healthy mesh.
        if p not in texts:
            texts[p] = complete(p, LONG)
        return texts[p]

    try:
        bring_up()
        check_completions()
        # Reference texts first, all at once (batched), while the cluster is undisturbed.
        wanted = [prompt(i) for i in list(range(12)) + [500]]
        with concurrent.futures.ThreadPoolExecutor(len(wanted)) as pool:
            texts.update(zip(wanted, pool.map(lambda p: complete(p, LONG), wanted)))
        check_scale_up()
        check_scale_down(expected)
        check_kill(expected)
        check_prometheus()
        check_planner_scales_compose()
    except BaseException:
        for service in ("router", "decode"):
            for name in containers(service):
                out = subprocess.run(["docker", "logs", "--tail", "40", name],
                                     capture_output=True, text=True)
                print(f"--- {name}\n{out.stdout}{out.stderr}", file=sys.stderr)
        raise
    finally:
        check_down()
    check_dockerfile_image()
    log(f"all checks passed in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
