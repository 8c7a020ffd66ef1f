"""torch.compile and the kernels: the public single ops are torch.library custom ops while traced.

``torch.ops.zenflow_kernels.{column_scores, topk_columns, selective_adamw_}`` carry fake implementations
and the in-place op declares what it writes, so a user's ``torch.compile(fullgraph=True)`` function that
calls the public ops compiles without a graph break and computes what eager mode computes.
"""

import pytest
import torch

import zenflow_kernels as zk

pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py: the CPU fast path, not Triton's interpreter)


def _inputs(dtype, R=6, C=11, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(R, C, generator=g).to(dtype)
    param = torch.randn(R, C, generator=g).to(dtype)
    m, v = torch.zeros(R, k), torch.zeros(R, k)
    master = param[:, :k].float().clone() if dtype != torch.float32 else None
    return grad, param, m, v, master


def _select_and_step(grad, param, m, v, master, steps, k):
    idx = zk.topk_columns(zk.column_scores(grad, "l1"), k)
    zk.selective_adamw_(param, grad, idx, m, v, step=steps, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                        weight_decay=0.1, master=master, grad_scale=2.0)
    return idx


@pytest.mark.parametrize("per_column_steps", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fullgraph_compile_of_the_public_ops_matches_eager(dtype, per_column_steps):
    torch._dynamo.reset()
    k = 4
    eager_in = _inputs(dtype)
    compiled_in = [None if t is None else t.clone() for t in eager_in]
    steps_e = torch.tensor([1, 3, 2, 5]) if per_column_steps else 3
    steps_c = steps_e.clone() if per_column_steps else 3
    compiled = torch.compile(_select_and_step, fullgraph=True)  # raises on any graph break
    for _ in range(2):  # in-place updates accumulate: a second call sees the first's writes
        idx_e = _select_and_step(*eager_in, steps_e, k)
        idx_c = compiled(*compiled_in, steps_c, k)
        assert torch.equal(idx_e, idx_c)
        for a, b in zip(eager_in, compiled_in, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_custom_ops_are_registered_and_pass_opcheck():
    grad, param, m, v, master = _inputs(torch.bfloat16)
    idx = torch.tensor([0, 2, 5, 7])
    torch.library.opcheck(torch.ops.zenflow_kernels.column_scores.default, (grad, "l2"))
    torch.library.opcheck(torch.ops.zenflow_kernels.topk_columns.default, (torch.rand(11), 4, True))
    torch.library.opcheck(
        torch.ops.zenflow_kernels.selective_adamw_.default,
        (param, grad, idx, m, v, None, 2, 1e-2, 0.9, 0.99, 1e-8, 0.1, master, 1.0, True),
    )


def test_custom_ops_raise_the_eager_errors():
    with pytest.raises(ValueError, match="importance"):
        torch.ops.zenflow_kernels.column_scores(torch.zeros(3, 3), "l3")
    with pytest.raises(ValueError, match="0 <= k <= 4, got 9"):
        torch.ops.zenflow_kernels.topk_columns(torch.zeros(4), 9, True)


def test_compiled_step_and_compiled_model_train_like_eager():
    """``torch.compile(opt.step)`` works from its first call (the step runs eagerly inside), and a compiled
    model trains with ZenFlowAdamW exactly as the eager model does."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)) for _ in range(10)]
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True)
    results = []
    for compiled in (False, True):
        model = torch.nn.Sequential(*[torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6)])
        model.load_state_dict(base.state_dict())
        with zk.ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow=zenflow) as opt:
            forward = torch.compile(model) if compiled else model
            step = torch.compile(opt.step) if compiled else opt.step
            for x, y in batches:
                opt.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                step()
            opt.flush()
            assert opt.t == len(batches) and opt.host_updates == 5
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # inductor may fuse the forward differently
