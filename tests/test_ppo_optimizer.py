"""The trainer's AdamW: torch's fused kernel where there is one; the default's update to rounding."""

import torch

from oppo_engine.ppo.trainer import adamw


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _train(opt_for, steps: int = 3) -> list[torch.Tensor]:
    model = _model(0)
    opt = opt_for(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_cpu_fp32_weights_get_the_fused_kernel_and_the_default_update_to_rounding():
    fused = adamw(_model(0).parameters(), lr=1e-3)
    assert fused.defaults["fused"] is True
    got = _train(lambda ps: adamw(ps, lr=1e-3))
    want = _train(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    moved = max((w - w0).abs().max().item() for w, w0 in zip(want, _model(0).parameters(), strict=True))
    assert moved > 1e-4  # the steps moved the weights: the comparison below can fail
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_weights_without_a_fused_kernel_get_the_default_adamw():
    for param in (torch.zeros(4, device="meta"), torch.zeros(4, dtype=torch.complex64)):
        opt = adamw([torch.nn.Parameter(param), torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
        assert not opt.defaults["fused"]  # None: torch's own choice (foreach on CUDA), not fused=False


def test_a_parameter_that_is_a_view_of_a_wider_buffer_gets_the_default_adamw_and_its_update():
    """torch's fused CPU kernel steps a parameter whose strides differ from its gradient's wrongly, without an
    error: such a parameter gets the default AdamW, and the update is the default's."""

    def trained(opt_for) -> torch.Tensor:
        buffer = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
        weight = torch.nn.Parameter(buffer[:, ::2])  # a view: not contiguous
        assert not weight.is_contiguous()
        opt = opt_for([weight])
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            (x @ weight).square().sum().backward()
            opt.step()
        return weight.detach().clone()

    assert not adamw([torch.nn.Parameter(torch.zeros(8, 12)[:, ::2])], lr=1e-2).defaults["fused"]
    want = trained(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    torch.testing.assert_close(trained(lambda ps: adamw(ps, lr=1e-2)), want, rtol=0, atol=0)


def test_frozen_parameters_do_not_decide_the_kernel():
    """Only trained parameters need the fused kernel: a frozen one of another dtype does not turn it off."""
    frozen = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64), requires_grad=False)
    assert adamw([torch.nn.Parameter(torch.zeros(4)), frozen], lr=1e-3).defaults["fused"] is True
