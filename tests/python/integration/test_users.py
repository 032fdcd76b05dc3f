"""Real users of torch.distributed on backend "tpcomm": DDP and FSDP2 training
loops give the same parameters as the same loops over plain Gloo."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 4))


def _batches(rank, steps):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(steps)]


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _ddp_bit_identical(ctx, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP
    # bucket_cap_mb small so that several buckets (and allreduces) run per step.
    ours = DDP(_model(), process_group=dist.group.WORLD, bucket_cap_mb=0.001)
    ref = DDP(_model(), process_group=ctx.ref, bucket_cap_mb=0.001)
    batches = _batches(ctx.rank, steps)
    losses = _train(ours, batches)
    ref_losses = _train(ref, batches)
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert torch.equal(p, q), f"{name} differs from the gloo run"
    assert losses == ref_losses
    # The replicas agree across ranks too.
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat, group=ctx.ref)
    assert all(torch.equal(g, flat) for g in gathered)
    return losses[-1]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_is_bit_identical_to_gloo(groups, world_size):
    losses = groups(world_size).run(_ddp_bit_identical, 20)
    assert len(losses) == world_size


def _fsdp2_matches_gloo(ctx, steps):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def run(pg):
        model = _model()
        mesh = DeviceMesh.from_group(pg, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        losses = _train(model, _batches(ctx.rank, steps))
        full = [p.full_tensor() for p in model.parameters()]
        return losses, full

    losses, params = run(dist.group.WORLD)
    ref_losses, ref_params = run(ctx.ref)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert losses == ref_losses
    return losses[-1]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_matches_gloo(groups, world_size):
    losses = groups(world_size).run(_fsdp2_matches_gloo, 10)
    assert len(losses) == world_size


def _dtensor_tensor_parallel(ctx, compiled):
    """DTensor's own tensor parallelism (colwise then rowwise Linear) on the
    tpcomm default group, eager or under torch.compile, against the same
    model unsharded in this process."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    reference = mlp()
    sharded = parallelize_module(mlp(), DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                                 {"0": ColwiseParallel(), "2": RowwiseParallel()})
    run = torch.compile(sharded, backend="aot_eager", fullgraph=False) if compiled else sharded
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    out = run(x)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)
    return float(out.sum())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dtensor_parallelize_module_matches_the_unsharded_model(shm_groups, compiled):
    # The shared-memory path on (a failed set-up would be an error).
    sums = shm_groups(2).run(_dtensor_tensor_parallel, compiled, timeout_s=300)
    assert len(set(sums)) == 1, sums
