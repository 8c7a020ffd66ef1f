"""Host (CPU) kernels for the offloaded shards: numba, fused, multithreaded, GIL released.

Public API
    cpu_adam_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              adamw=True, bias_correction=True, grad_scale=1.0, out=None, num_threads=None)
    accumulate_(acc, grad, *, num_threads=None)
    accumulate_adam_(param, acc, grad, exp_avg, exp_avg_sq, *, step, lr, ..., grad_scale=1.0,
                     out=None, zero_acc=False, num_threads=None)
    sum_squares(x, *, num_threads=None) -> float
    split_cores(pt_reserved_cores_perc, cores=None) -> (train_cores, host_cores)

All tensors are contiguous CPU tensors; state (param, moments, accumulation buffer) is fp32;
gradients may be fp32, bf16 or fp16; ``out`` may be fp32, bf16 or fp16. Each op is one pass over
memory, validated completely before anything is written.

Threads: every op takes ``num_threads``; ``None`` means the calling thread's
``numba.get_num_threads()``. ``numba.set_num_threads`` is thread-local, so a background worker
thread starts at ``NUMBA_NUM_THREADS`` whatever the main thread set: pass ``num_threads`` (e.g.
``len(host_cores)`` from ``split_cores``) from the worker. The kernels release the GIL, so a worker
thread running them overlaps with torch work in the main thread; concurrent launches from several
threads are safe on numba's OpenMP and TBB threading layers and are serialised on ``workqueue``
(see ``_common``).

Sharing cores with torch. numba's OpenMP layer and torch run two separate OpenMP runtimes (numba
links the system libgomp, torch its bundled copy), and an idle OpenMP worker spin-waits for a few
milliseconds after each parallel region. Give each side its own cores: ``split_cores`` then
``torch.set_num_threads(len(train))`` in the training thread and ``num_threads=len(host)`` here.
Measured on 2 cores, host Adam (2^22 params) in a worker thread next to 512x512 matmuls in the main
thread, throughput as a fraction of each running alone, summed (2.0 = perfect overlap): 1 + 1
threads 1.9-2.1; 2 + 2 threads (oversubscribed) 1.1-1.2, or 1.3 with ``OMP_WAIT_POLICY=PASSIVE``
set before torch is imported; 1 host + 2 torch threads 1.1-1.2, 1.55-1.6 with PASSIVE.

First call of each dtype combination compiles (about 1-2 s); compiled code is cached in
``__pycache__`` (``cache=True``) and loads in milliseconds afterwards.
"""

from .accumulate import accumulate_, sum_squares
from .adam import accumulate_adam_, cpu_adam_
from .cores import split_cores

__all__ = ["accumulate_", "accumulate_adam_", "cpu_adam_", "split_cores", "sum_squares"]
