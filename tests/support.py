"""What several test modules share: the optimizer tests' small model and gradient sequence, the sweep of
configurations, and helpers to drive an optimizer (no test module imports another: they import this)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from zenflow_kernels.config import ZenFlowWarning
from zenflow_kernels.streamed_host import DeviceSums
from zenflow_kernels.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
ZERO_WORKER = Path(__file__).resolve().parent / "zero_worker.py"

# a small model's parameters: two linear layers with biases, a norm, and an embedding-like matrix
SHAPES = [(24, 16), (24,), (12, 24), (12,), (12,), (40, 12)]
HYPER = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def make_params(dtype=torch.float32, seed=0, device="cpu", shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes]


def snapshot(params):
    return [p.detach().to("cpu", copy=True) for p in params]


def params_at(weights):
    """``make_params()`` holding ``weights`` (a :func:`snapshot`): a fresh model to load a checkpoint into."""
    params = make_params()
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    return params


def grad_sequence(steps, seed=1, dtype=torch.float32):
    """Gradients fixed in advance (a loss linear in the weights) with a few dominant, slowly drifting
    columns per matrix, so that selections are well separated and change over time."""
    g = torch.Generator().manual_seed(seed)
    seq = []
    for t in range(steps):
        step = []
        for shape in SHAPES:
            x = torch.randn(shape, generator=g)
            if len(shape) == 2:
                cols = shape[1]
                boost = torch.ones(cols)
                for j in range(3):
                    boost[(3 * j + t // 7) % cols] = 4.0 + j  # the hot columns shift every 7 steps
                x = x * boost
            step.append(x.to(dtype))
        seq.append(step)
    return seq


def drive(opt, params, grads):
    history = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.to(p.device, p.dtype, copy=True)
        opt.step()
        history.append(snapshot(params))
    return history


def backward_and_step(opt, loss, scaler=None) -> None:
    """One step of the loop people write: ``loss.backward(); opt.step()``, or under a ``torch.amp.GradScaler`` its
    recipe (scale, backward, ``scaler.step``, ``scaler.update``)."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def quiet(factory, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZenFlowWarning)
        return factory(*args, **kwargs)


# -- the sweep of configurations the oracle tests run ---------------------------------------------------

TOPK = [0.0, 0.1, 1.0]
UPDATE = [1, 3, "auto"]
OVERLAP = [False, True]
DTYPES = [torch.float32, torch.bfloat16]
# the remaining axes rotate through the product above so every value meets every other often
WARMUP = [0, 3]
STRATEGY = [("step", 10, None), ("epoch", 1, 8), ("epoch", 1, None), ("auto", "auto", 10)]
IMPORTANCE = ["l2", "l1"]
SWEEP = [
    (topk, upd, ov, dt, WARMUP[n % 2], STRATEGY[n % 4], IMPORTANCE[(n // 2) % 2])
    for n, (topk, upd, ov, dt) in enumerate(itertools.product(TOPK, UPDATE, OVERLAP, DTYPES))
]


def _ids(case):
    topk, upd, ov, dt, wu, (strategy, interval, epoch), imp = case
    return f"k{topk}-u{upd}-{'ov' if ov else 'sync'}-{str(dt)[6:]}-wu{wu}-{strategy}{interval}e{epoch}-{imp}"


def adamw_history(grads, shapes=SHAPES, **hyper):
    ap = make_params(shapes=shapes)
    return drive(torch.optim.AdamW(ap, **(HYPER | hyper), foreach=False), ap, grads)


def adamw_tol(device):
    """torch.optim.AdamW on CPU against our CPU kernels: a few ulps; against the Triton kernels (whose
    bias corrections come from exp/log) a little more."""
    return dict(rtol=1e-6, atol=1e-7) if device.type == "cpu" else dict(rtol=1e-5, atol=1e-6)


# -- rank processes ---------------------------------------------------------------------------------------------


def launch(cases: list[dict], tmp_path: Path, world: int = 2, timeout: float = 240.0, worker: Path = ZERO_WORKER):
    """Run the cases on ``world`` ranks (``worker``: the script each rank runs); returns ({case: [rank
    results]}, [completed processes])."""
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(spec), str(tmp_path)], cwd=ROOT,
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    done = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"the ranks did not finish within {timeout} s (a hang)") from None
        done.append((p.returncode, out, err))
    results = {}
    for case in cases:
        files = [tmp_path / f"{case['name']}-rank{r}.pt" for r in range(world)]
        if all(f.exists() for f in files):
            results[case["name"]] = [torch.load(f, weights_only=False) for f in files]
    return results, done


def assert_same_state(a, b, what: str) -> None:
    """Two state dicts hold the same tensors bit for bit (and the same everything else), ``offload_device`` and
    ``nvme_path`` aside."""
    if isinstance(a, dict):
        assert set(a) == set(b), what
        for k in a:
            if k not in ("offload_device", "nvme_path"):
                assert_same_state(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{what}[{k}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), what
    else:
        assert a == b, what


# -- the NVMe host's streamed update --------------------------------------------------------------------------


def recording_device_sums(flat, block_numel, depth, fetched):
    """``DeviceSums`` over ``flat`` (the stand-in for a device tensor) recording each fetched range."""
    def fetch(dst, lo, hi):
        fetched.append((lo, hi))
        dst.copy_(flat[lo:hi])

    return DeviceSums(fetch, [torch.full((block_numel,), float("nan")) for _ in range(depth)])
