"""Stress the GPU virtual world and diagnose waits that never complete (run on a GPU machine).

    PYTHONPATH=. python benchmarks/probes/diag_virtual_stalls.py streams=pool programs=default seconds=60
    PYTHONPATH=. python benchmarks/probes/diag_virtual_stalls.py gate=0 seconds=60

Loops the GPU test sequence (check_collectives over sizes, dtypes, W in 1..8) and a rapid
all_gather/reduce_scatter/all_reduce stress at W=4 and W=8. A launch slower than WATCH seconds
dumps every rank thread's stack and every rank's signal pad (arrivals, meta, epoch): a kernel
that never started shows as a rank whose arrivals stay one epoch behind. Modes: ``streams``
``pool`` (torch's stream pool) or ``driver`` (fresh cuStreamCreate streams); ``programs``
``default`` or ``half`` (half the collective programs per rank). Prints ok/fail counts.

What it found on the H200 (the launch gate, ``VirtualGroup.waiting_launch``: 7 of 96 launches
timed out without it, 0 of 224 with it): benchmarks/NOTES.md, virtual world.
"""
import ctypes, os, sys, threading, time, traceback, itertools
from ditron_ops import _env
_env.prepare_cuda_for_virtual_ranks()
import torch, ditron_ops
from ditron_ops.runtime import virtual
from ditron_ops.collectives import _launch
from ditron_ops.testing import check_collectives, make_input

args = dict(a.split("=") for a in sys.argv[1:])
STREAMS, PROGS, SECS = args.get("streams", "pool"), args.get("programs", "default"), float(args.get("seconds", 60))
GATE = args.get("gate", "1") != "0"
WATCH = 2.5
print("env", {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING")},
      "mode", STREAMS, PROGS, flush=True)
_cuda = ctypes.CDLL("libcuda.so.1")
_latest = {}
_orig_init = virtual.VirtualWorld.__init__

def _init(self, *a, **k):
    _orig_init(self, *a, **k)
    if self.device.type == "cuda" and STREAMS == "driver":
        torch.cuda.current_device()
        streams = []
        for _ in range(self.world_size):
            s = ctypes.c_void_p()
            assert _cuda.cuStreamCreate(ctypes.byref(s), 1) == 0
            streams.append(torch.cuda.ExternalStream(s.value, device=self.device))
        self.streams = streams
    _latest["world"] = self
virtual.VirtualWorld.__init__ = _init
if PROGS == "half":
    _orig_ppr = _launch.programs_per_rank
    def ppr(group):
        if group.device.type != "cuda":
            return 1
        w = group.world_size
        return max(2, min(32, _launch._sm_count(group.device.index) // w))
    _launch.programs_per_rank = ppr

diag_stream = torch.cuda.Stream()

def dump(tag):
    world = _latest.get("world")
    frames = sys._current_frames()
    for t in threading.enumerate():
        if t.name.startswith("ditron"):
            stack = traceback.format_stack(frames.get(t.ident))
            print(f"  [{tag}] {t.name} at:", "".join(stack[-4:]).replace("\n", " | ")[-700:], flush=True)
    if world is None:
        return
    with torch.cuda.stream(diag_stream):
        for g in world.groups:
            ws = g._workspaces.get("collectives")
            if ws is None:
                print(f"  [{tag}] rank {g.rank}: no workspace"); continue
            pad = ws.signal_pad().to("cpu").tolist()
            w = g.world_size
            print(f"  [{tag}] rank {g.rank} P={getattr(ws,'programs',None)} arrivals={pad[:w]} meta={pad[w:3*w]} "
                  f"epoch={pad[3*w]} done={pad[3*w+1]} rec={g._error_record.tolist()[:6]}", flush=True)

def timed_launch(fn, w, fargs, label):
    done = threading.Event()
    def watch():
        if not done.wait(WATCH):
            print(f"SLOW {label} (> {WATCH}s)", flush=True)
            dump("slow")
    t = threading.Thread(target=watch, daemon=True); t.start()
    t0 = time.perf_counter()
    try:
        ditron_ops.launch(fn, w, args=fargs, timeout_s=5, gate=GATE)
        ok = True
    except Exception as e:
        ok = False
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    done.set()
    return ok, time.perf_counter() - t0

def stress(group, n, seed):
    import random
    rng = random.Random(seed)
    for i in range(n):
        rows, cols = rng.randint(1, 300), rng.choice([1, 3, 8, 64, 129])
        x = make_input((rows, cols), torch.float32, group.device, seed + i * 31 + group.rank)
        sizes = [max(0, rows - q) for q in range(group.world_size)]
        op = i % 4
        if op == 0:
            ditron_ops.all_gather(x[: sizes[group.rank]], shard_sizes=sizes)
        elif op == 1:
            ditron_ops.reduce_scatter(x)
        elif op == 2:
            ditron_ops.all_reduce(x, algorithm="one_shot")
        else:
            ditron_ops.all_gather(x)
    group.synchronize()
    return n

t_end = time.time() + SECS
stats = {"ok": 0, "fail": 0, "slow": 0}
rnd = 0
while time.time() < t_end:
    rnd += 1
    for (rows, cols), dt, w in itertools.product([(4099, 1001), (37, 3)],
                                                 [torch.bfloat16, torch.float16, torch.float32], [1, 2, 3, 4, 8]):
        ok, dt_s = timed_launch(check_collectives, w, (rows, cols, dt), f"r{rnd} check {rows}x{cols} {dt} W={w}")
        stats["ok" if ok else "fail"] += 1
        stats["slow"] += dt_s > WATCH
    for w in (4, 8):
        ok, dt_s = timed_launch(stress, w, (200, rnd), f"r{rnd} stress W={w}")
        stats["ok" if ok else "fail"] += 1
        stats["slow"] += dt_s > WATCH
    print(f"round {rnd} done {stats}", flush=True)
print("FINAL", STREAMS, PROGS, stats, flush=True)
