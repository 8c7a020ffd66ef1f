"""Host (CPU) kernels for the offloaded shards: numba, fused, multithreaded, GIL released.

Public API
    cpu_adam_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              adamw=True, bias_correction=True, grad_scale=1.0, out=None, zero_grad=False,
              num_threads=None, rounding=None)
    cpu_lion_(param, grad, exp_avg, *, lr, beta1, beta2, weight_decay, grad_scale=1.0, out=None,
              zero_grad=False, num_threads=None, rounding=None)
    cpu_sgd_(param, grad, momentum_buffer, *, step, lr, momentum=0.0, dampening=0.0, nesterov=False,
             weight_decay=0.0, grad_scale=1.0, out=None, zero_grad=False, num_threads=None, rounding=None)
    accumulate_(acc, grad, *, num_threads=None)
    multi_accumulate_(accs, grads, *, num_threads=None)
    accumulate_adam_(param, acc, grad, exp_avg, exp_avg_sq, *, step, lr, ..., grad_scale=1.0,
                     out=None, zero_acc=False, num_threads=None, rounding=None)
    sum_squares(x, *, num_threads=None) -> float
    multi_sum_squares(tensors, *, num_threads=None) -> float
    split_cores(pt_reserved_cores_perc, cores=None) -> (train_cores, host_cores)
    rank_cores(affinity=None) -> (cores, why)       this local rank's CPUs on a node shared by several ranks
    physical_cores(cpus) -> cpus                      one logical CPU per physical core

``rounding``: None (bf16 state rounded to nearest even) or a ``zenflow_kernels.rounding.StochasticRounding`` (bf16
state rounded stochastically, deterministic: the bits of ``rounding.round_to_bf16``).

All tensors are contiguous CPU tensors; param and accumulation buffer are fp32, the moments fp32 or bf16;
gradients may be fp32, bf16 or fp16; ``out`` may be fp32, bf16 or fp16. Each op is one pass over
memory, validated completely before anything is written.

Threads: every op takes ``num_threads``; ``None`` means the calling thread's
``numba.get_num_threads()``. ``numba.set_num_threads`` is thread-local, so a background worker
thread starts at ``NUMBA_NUM_THREADS`` whatever the main thread set: pass ``num_threads`` (e.g.
``len(host_cores)`` from ``split_cores``) from the worker. The kernels release the GIL, so a worker
thread running them overlaps with torch work in the main thread; concurrent launches from several
threads are safe on numba's OpenMP and TBB threading layers and are serialised on ``workqueue``
(see ``_common``).

Sharing cores with torch. torch is imported first (this package does so), and numba's OpenMP layer
then binds to the libgomp torch loaded: one OpenMP runtime for both. A launch from the main thread
reuses torch's thread team; a launch from another thread (the host worker) starts a second team that
lives as long as that thread. Idle OpenMP threads spin for a while after each parallel region, but
once the runtime's threads outnumber the cores it makes them sleep at once, and every parallel op of
the training thread then pays a wake-up (measured on 2 cores: forward + backward of a small GPT 20-40%
slower while a worker thread that ran a 2-thread kernel is alive; none with a 1-thread kernel, which
starts no team). So give each side its own cores: ``split_cores`` then ``torch.set_num_threads(len(train))``
in the training thread and ``num_threads=len(host)`` here; where the sides must share cores, give the
worker only the threads torch leaves free, at least 1 (``ZenFlowAdamW`` does both). Measured on 2 cores,
host Adam (2^22 params) in a worker thread next to 512x512 matmuls in the main thread, throughput as a
fraction of each running alone, summed (2.0 = perfect overlap): 1 + 1 threads 1.9-2.1; 2 + 2 threads
(oversubscribed) 1.1-1.2, or 1.3 with ``OMP_WAIT_POLICY=PASSIVE`` set before torch is imported;
1 host + 2 torch threads 1.1-1.2, 1.55-1.6 with PASSIVE.

First call of each dtype combination compiles (about 1-2 s); compiled code is cached in
``__pycache__`` (``cache=True``) and loads in milliseconds afterwards.
"""

from .accumulate import accumulate_, multi_accumulate_, multi_sum_squares, sum_squares
from .adam import accumulate_adam_, cpu_adam_
from .cores import physical_cores, rank_cores, split_cores
from .lion import cpu_lion_
from .sgd import cpu_sgd_

__all__ = ["accumulate_", "accumulate_adam_", "cpu_adam_", "cpu_lion_", "cpu_sgd_", "multi_accumulate_",
           "multi_sum_squares", "physical_cores", "rank_cores", "split_cores", "sum_squares"]
