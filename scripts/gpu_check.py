"""Checks of a sharded zone's device paths, for a machine with a GPU (`scripts/gpu-check` runs it).

    python scripts/gpu_check.py            # about a minute; prints every figure, exits 1 on a failure

1. The device: torch, CUDA, each GPU (name, id, memory), NCCL's version, and where a zone of
   two processes on this machine keeps its shards (`unbroken.comm.placement.place`).
2. A zone of 2 processes (`ShardedModel`, SGD with momentum) trains 4 steps on the device, placed as a node
   places it (NCCL with a GPU each; gloo with the shards on the CPU, staged, on one GPU),
   against the same zone on the CPU: each range's two holders bit-identical on the device,
   and the model within float noise of the CPU's.
3. A zone of 1 process on NCCL (every GPU machine has one GPU): the group built over gloo
   (`build_nccl`), the gathers and sums on the device, polled waits; against the CPU.
4. With 2 GPUs or more: a hung peer under NCCL. Rank 1 never joins a sum; rank 0's wait
   ends at its deadline, the group is aborted, and a new group of both sums again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.nn import functional as F

STEPS, B, VOCAB, CONTEXT = 4, 8, 64, 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 64)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True) for _ in range(2)
        )
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo(store: Any, prefix: str, rank: int, size: int) -> Any:
    from torch._C._distributed_c10d import ProcessGroupGloo
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    opts = ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=60)
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, opts)


def sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """SGD with momentum: its update follows the gradient (Adam's is bounded whatever the
    gradient, so a wrong sum would hide inside its float noise), and it keeps state."""
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def zone_run(rank: int, n: int, port: int, kind: str) -> dict[str, Any]:
    """``n`` members train STEPS steps computing on ``kind`` (cpu, cuda); what member ``rank`` holds."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from unbroken.comm.group import EpochScope
    from unbroken.comm.nccl import build_nccl, nccl_environment
    from unbroken.comm.placement import Backend, member_device, place
    from unbroken.comm.sharded import ShardedModel
    from unbroken.state.shards import layout_for

    torch.set_num_threads(1)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        nccl_environment()  # as a node does at its start
    store = TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
    members = [f"n{i}" for i in range(n)]
    devices = {m: member_device(torch.device("cuda", i % torch.cuda.device_count()) if kind == "cuda" else
                                torch.device("cpu")) for i, m in enumerate(members)}  # fmt: skip
    placement = place(devices, members[rank], device)
    scope = EpochScope(threading.Event(), lambda: None, 60.0)
    group = gloo(store, "g/", rank, n)
    built = ""
    if placement.backend is Backend.NCCL:
        t0 = time.perf_counter()
        group = build_nccl(group, "nccl0", rank, n, device, scope)[0]
        built = f"{(time.perf_counter() - t0) * 1e3:.0f} ms"
    model = Model()
    numel = sum(p.numel() for p in model.parameters())
    zone = ShardedModel(
        model, layout_for(numel, {m: 1 for m in members}), members[rank], {m: i for i, m in enumerate(members)},
        group, scope, sgd, blocks=[model.embed, *model.layers, model.head],
        placement=placement,
    )  # fmt: skip
    times = []
    for step in range(STEPS):
        t0 = time.perf_counter()
        tokens = torch.randint(0, VOCAB, (B, CONTEXT + 1), generator=torch.Generator().manual_seed(step))
        lo, hi = B * rank // n, B * (rank + 1) // n
        x, y = tokens[lo:hi, :-1].to(device), tokens[lo:hi, 1:].to(device)
        (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) * ((hi - lo) / B)).backward()
        zone.finish_backward()
        zone.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    state = {k: v.numpy() for k, v in zone.full_state().items()}
    on = {str(piece.tensor.device) for h in zone.holdings for piece in h.pieces}
    return {
        "state": state, "digests": zone.digests(), "placement": placement.reason, "shards_on": sorted(on),
        "built": built, "step_ms": 1e3 * min(times[1:]),
    }  # fmt: skip


def child(target: Any, rank: int, q: Any, args: tuple[Any, ...]) -> None:
    """A spawned process: ``target(*args)``'s result, or its error, put on ``q`` for rank ``rank``."""
    try:
        q.put(("done", rank, target(*args)))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def spawn(n: int, target: Any, args: Any, what: str, timeout: float) -> dict[int, dict[str, Any]]:
    """``target(*args(rank, port))`` in ``n`` spawned processes; what each returned."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=child, args=(target, r, q, args(r, port))) for r in range(n)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    try:
        while len(out) < n:
            kind, rank, payload = q.get(timeout=timeout)
            if kind == "error":
                raise RuntimeError(f"rank {rank}{what}:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return out


def zone(n: int, kind: str) -> dict[int, dict[str, Any]]:
    return spawn(n, zone_run, lambda r, port: (r, n, port, kind), f" on {kind}", 240)


def compare(n: int) -> bool:
    gpu, cpu = zone(n, "cuda"), zone(n, "cpu")
    by_range: dict[str, set[str]] = {}
    for d in gpu.values():
        for span, digest in d["digests"].items():
            by_range.setdefault(str(span), set()).add(digest)
    agree = all(len(v) == 1 for v in by_range.values())
    diff = max(
        float(abs(torch.from_numpy(gpu[0]["state"][k]) - torch.from_numpy(v)).max()) for k, v in cpu[0]["state"].items()
    )
    print(f"  placement: {gpu[0]['placement']}")
    print(
        f"  shards on: {gpu[0]['shards_on']}" + (f"; NCCL group built in {gpu[0]['built']}" if gpu[0]["built"] else "")
    )
    print(
        f"  step: {gpu[0]['step_ms']:.1f} ms on the device, {cpu[0]['step_ms']:.1f} ms on the CPU (best of {STEPS - 1})"
    )
    print(f"  ranges held twice, bit-identical on the device: {agree} ({len(by_range)} ranges)")
    print(f"  model after {STEPS} SGD steps, device vs CPU: max abs diff {diff:.2e} (float noise: below 1e-4)")
    return agree and diff < 1e-4


def hung_peer(rank: int, port: int) -> dict[str, Any]:
    """Rank 1 builds the group and never joins the sum; rank 0 must leave at its deadline."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from unbroken.comm.group import EpochScope, wait_polled
    from unbroken.comm.nccl import build_nccl, nccl_environment
    from unbroken.errors import CollectiveFailed

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    nccl_environment()
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
    over = gloo(store, "g/", rank, 2)
    scope = EpochScope(threading.Event(), lambda: None, 60.0)
    pg = build_nccl(over, "nccl-a", rank, 2, device, scope)[0]
    t = torch.ones(4, device=device)
    if rank == 0:
        t0 = time.perf_counter()
        try:
            wait_polled([pg.allreduce([t])], EpochScope(threading.Event(), lambda: None, 3.0), "summing", pg)
            left = "the sum completed: rank 1 was meant to hang"
        except CollectiveFailed as exc:
            left = f"left after {time.perf_counter() - t0:.2f} s: {str(exc)[:100]}"
    else:
        left = "hung"
    store.set(f"left/{rank}", "1")
    store.wait([f"left/{1 - rank}"])
    again = build_nccl(over, "nccl-b", rank, 2, device, scope)[0]
    u = torch.full((4,), float(rank + 1), device=device)
    wait_polled([again.allreduce([u])], scope, "summing again", again)
    return {"left": left, "again": u.tolist()}


def hang() -> bool:
    out = spawn(2, hung_peer, lambda r, port: (r, port), "", 120)
    print(f"  rank 0: {out[0]['left']}")
    print(f"  a new group of both, after the abort: sum = {out[0]['again']} (want 3.0 each)")
    return out[0]["left"].startswith("left after") and out[0]["again"] == [3.0] * 4


def describe() -> None:
    import torch.distributed as dist

    from unbroken.comm.placement import member_device, place

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {os.cpu_count()} CPU cores")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch: this check is for a GPU machine")
    for i in range(torch.cuda.device_count()):
        d = member_device(torch.device("cuda", i))
        free, total = torch.cuda.mem_get_info(i)
        print(f"  cuda:{i}: {d.name}, id {d.uuid}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free)")
    nccl = dist.is_nccl_available()
    v = torch.cuda.nccl.version() if nccl else "none"
    version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    print(f"NCCL in torch: {nccl} (version {version})")
    count = torch.cuda.device_count()
    two = {f"n{r}": member_device(torch.device("cuda", r % count)) for r in range(2)}
    print(f"a zone of 2 processes here: {place(two, 'n0', torch.device('cuda', 0)).reason}")


def main() -> None:
    describe()
    checks = [
        ("2-process zone on the device vs the CPU", lambda: compare(2)),
        ("1-process NCCL zone vs the CPU", lambda: compare(1)),
    ]
    if torch.cuda.device_count() >= 2:
        checks.append(("a hung peer under NCCL: deadline, abort, a new group", hang))
    else:
        print("one GPU: the hung-peer check under NCCL needs two (skipped)")
    failed = []
    for name, check in checks:
        print(f"{name}:", flush=True)
        try:
            ok = check()
        except Exception:
            traceback.print_exc()
            ok = False
        print(f"  -> {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed.append(name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
