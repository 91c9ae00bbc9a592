#!/usr/bin/env python3
"""Start-up time and RSS of an mcp-xds-gateway binary (BENCHMARKS.md, "Every
Envoy extension in YAML"), each case RUNS times, min..max and median:

- embedded: `--demo` (the compiled-in examples/config, Istio's kinds), from
  an empty directory;
- istio-dir: `--source-dir` of a copy of ISTIO_EXAMPLES_DIR;
- json-added: then ENVOY_EXAMPLES_DIR's files (Envoy `json` bodies) copied
  into it: the time until the listeners are served (the watcher's 100 ms
  settle included) and the RSS after;
- envoy-dir: `--source-dir ENVOY_EXAMPLES_DIR` from the start.

Time is from the spawn to `/readyz` answering 200; RSS is VmRSS (and
VmHWM, the peak) half a second after. mcp-load measures serving under
load; this measures a gateway at rest, which it has no scenario for.

usage: startup.py BINARY ENVOY_EXAMPLES_DIR ISTIO_EXAMPLES_DIR RUNS"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

binary, envoy_dir, istio_dir, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
PORTS = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--monitoring-listen", "127.0.0.1:0"]

def rss_kib(pid):
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)), int(re.search(r"VmHWM:\s+(\d+)", status).group(1))

def get(admin, path):
    try:
        with urllib.request.urlopen(f"http://{admin}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""

def start(args, cwd):
    t0 = time.monotonic()
    p = subprocess.Popen([binary] + PORTS + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    admin = None
    for line in p.stdout:
        if "gateway listening" in line:
            admin = re.search(r"admin=(\S+)", line).group(1)
            break
    assert admin, "no banner"
    # Drain the rest of the log.
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    while get(admin, "/readyz")[0] != 200:
        time.sleep(0.002)
    return p, admin, time.monotonic() - t0

def served(admin, collection, n):
    while True:
        status, body = get(admin, f"/debug/cache/{collection}")
        if status == 200 and len(json.loads(body).get("resources", [])) >= n:
            return
        time.sleep(0.002)

def stop(p):
    p.terminate(); p.wait(timeout=15)

results = {k: [] for k in ["embedded", "istio-dir", "json-added", "json-latency", "envoy-dir"]}
for _ in range(runs):
    with tempfile.TemporaryDirectory() as empty:
        p, admin, ready = start(["--demo"], empty)
        time.sleep(0.5)  # at rest before RSS is read
        results["embedded"].append((ready, *rss_kib(p.pid)))
        stop(p)
    with tempfile.TemporaryDirectory() as d:
        for f in os.listdir(istio_dir):
            shutil.copy(os.path.join(istio_dir, f), d)
        p, admin, ready = start(["--source-dir", d], d)
        time.sleep(0.5)
        results["istio-dir"].append((ready, *rss_kib(p.pid)))
        t0 = time.monotonic()
        for f in os.listdir(envoy_dir):
            shutil.copy(os.path.join(envoy_dir, f), os.path.join(d, "envoy-" + f))
        served(admin, "envoy/config/listener/v3/listeners", 1)
        lat = time.monotonic() - t0
        time.sleep(0.5)
        results["json-added"].append((lat, *rss_kib(p.pid)))
        stop(p)
    with tempfile.TemporaryDirectory() as d:
        p, admin, ready = start(["--source-dir", envoy_dir], d)
        time.sleep(0.5)
        results["envoy-dir"].append((ready, *rss_kib(p.pid)))
        stop(p)

for k, rows in results.items():
    if not rows: continue
    t = sorted(r[0] * 1000 for r in rows); rss = sorted(r[1] / 1024 for r in rows); hwm = sorted(r[2] / 1024 for r in rows)
    print(f"{k:12} time {t[0]:.0f}..{t[-1]:.0f} ms (median {t[len(t)//2]:.0f}); RSS {rss[0]:.1f}..{rss[-1]:.1f} MiB (median {rss[len(rss)//2]:.1f}); peak {hwm[0]:.1f}..{hwm[-1]:.1f} MiB")
